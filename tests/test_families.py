"""Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2, SmolLM3 and Granite against HF transformers, end
to end (float32, CPU): a tiny random checkpoint per family with its quirks switched on, one
engine per family, greedy token ids equal to HF's for 4 prompts x 32 new tokens, batched with
a sampled request, with chunked prefill and a KV budget small enough to preempt.

Quirks: Gemma scales its embeddings, norms by (1 + w) and gates with GeGLU; Gemma 2
soft-caps attention scores and final logits and alternates 12-token sliding windows with
global layers; Gemma 3 adds q/k norms and rotates its global layers with yarn
(its local ones with their own base); Phi-3 has longrope short/long factors (decoding crosses
its original length), partial rotary and a window on every layer; OLMo 2 has its post-norms
and q/k norms over whole projections, here with dynamic NTK rope that grows past its 48
positions; Granite scales its embeddings, attention scores, sublayer outputs and logits by
its config's multipliers; SmolLM3 leaves q and k unrotated in its NoPE layer (windowed
here). Prompts (7-45 tokens) are longer than the windows.

Also: the language model of a multimodal Gemma 3 checkpoint, and Gemma's chat template
(no system role) in `LLM.chat` and the server.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    _GEMMA,
    GEMMA_CHAT_TEMPLATE,
    TINY_CONFIG,
    _randomize,
    hf_generate_greedy,
    hf_logits,
    hf_model,
    load_our_model,
    make_tiny_hf_model,
    run_paged,
    save_tiny_tokenizer,
)

from pagellm import LLM, SamplingParams

SLIDING, FULL = "sliding_attention", "full_attention"
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.2 * i for i in range(6)],
    "long_factor": [1.5 + 0.5 * i for i in range(6)],
}
FAMILIES = {
    # weights of std 0.3 (make_tiny_hf_model's argument): at 0.5, uncapped logits reach ~34
    # and float32's summation noise (~4e-6 of that) passes the 1e-4 bar of test_logits_equal_hf
    # Gemma 2's soft-caps in a Gemma 1 config (transformers keeps them): HF ignores them
    "gemma": dict(
        head_dim=16,
        pad_token_id=0,
        tie_word_embeddings=True,
        std=0.3,
        final_logit_softcapping=5.0,
        attn_logit_softcapping=5.0,
    ),  # fmt: skip
    "gemma2": dict(
        num_hidden_layers=3,  # sliding, global, sliding
        sliding_window=12,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
    ),
    "gemma3": dict(
        num_hidden_layers=3,
        layer_types=[SLIDING, FULL, SLIDING],
        sliding_window=12,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 1e6,
            },
        },
    ),
    "phi3": dict(
        sliding_window=12,
        partial_rotary_factor=0.75,  # 12 of 16 dims turn
        original_max_position_embeddings=48,
        max_position_embeddings=192,
        rope_scaling=LONGROPE,
    ),
    "olmo2": dict(max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "smollm3": dict(  # layer 1 of 2 without rotary, windowed
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=12,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "starcoder2": dict(sliding_window=12, norm_epsilon=1e-5, use_bias=True),
    "granite": dict(
        embedding_multiplier=6.0,
        attention_multiplier=0.03,
        residual_multiplier=0.4,
        logits_scaling=4.0,
        tie_word_embeddings=True,
    ),
}
PROMPT_LENGTHS = (7, 19, 33, 45)
# Phi-3 and StarCoder2 window every layer, so blocks before each window return to the pool:
# fewer blocks
NUM_BLOCKS = {"phi3": 16, "starcoder2": 16}
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, HF model, one engine) per family, the engine in this process."""
    name = request.param
    folder = make_tiny_hf_model(name, tmp_path_factory.mktemp(name), **FAMILIES[name])
    save_tiny_tokenizer(folder, GEMMA_CHAT_TEMPLATE)
    hf = hf_model(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        # blocks of 4 tokens, too few for ~230 tokens: preemption; 32-token steps: chunks
        llm = LLM(
            folder,
            dtype="float32",
            block_size=4,
            num_gpu_blocks_override=NUM_BLOCKS.get(name, 36),
            max_num_batched_tokens=32,
        )
    yield folder, hf, llm
    llm.shutdown()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_greedy_equals_hf_batched_and_preempted(family):
    """HF's `generate` is the reference (`hf_generate_greedy`): Phi-3's recomputes a sequence
    that passes its original length with the long factors; its extra first prompt is longer
    than that and shares the 45-token prompt's first 44 tokens (keyed apart in the prefix
    cache, they must not serve that prompt's short-factor prefill)."""
    _, hf, llm = family
    prompts = _prompts()
    if hf.config.model_type == "phi3":
        prompts.insert(0, prompts[-1][:44] + _prompts()[0][:16])
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20)  # a different neighbour
    requests = [{"prompt_token_ids": p} for p in [*prompts, prompts[1][:5]]]
    outputs = llm.generate(requests, [GREEDY] * len(prompts) + [sampled], use_tqdm=False)
    assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        expected = hf_generate_greedy(hf, [prompt], NEW_TOKENS)[0]
        assert out.outputs[0].token_ids == expected, len(prompt)


def test_logits_equal_hf(family):
    """Logits, not only their argmax (Gemma 2's final soft-cap keeps the argmax): one HF
    forward per sequence, so within the original length of Phi-3's and OLMo 2's rope."""
    folder, hf, _ = family
    ours = load_our_model(folder)
    prompts = _prompts()[:3]
    for tokens, logits in run_paged(ours, prompts, num_decode_steps=4, chunk_size=8, block_size=4):
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"], indirect=True)
def test_chat_template_without_system_role(family):
    _, _, llm = family
    user = [{"role": "user", "content": "tell me a story"}]
    out = llm.chat(user, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    turn = "<start_of_turn>user\ntell me a story<end_of_turn>\n<start_of_turn>model\n"
    assert out.prompt == "<bos>" + turn
    with pytest.raises(ValueError, match="System role not supported"):
        llm.chat([{"role": "system", "content": "be brief"}, *user], use_tqdm=False)


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_server_gives_the_template_error_as_400(family):
    folder, _, _ = family
    from fastapi.testclient import TestClient

    from pagellm import EngineArgs
    from pagellm.entrypoints.openai.api_server import build_app

    args = EngineArgs(model=folder, dtype="float32", num_gpu_blocks_override=64)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        with TestClient(build_app(args)) as client:
            bad = client.post("/v1/chat/completions", json={"messages": messages})
            good = client.post(
                "/v1/chat/completions", json={"messages": messages[1:], "max_tokens": 3}
            )
    assert bad.status_code == 400
    assert "System role not supported" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

    text = Gemma3TextConfig(**{**TINY_CONFIG, **_GEMMA, **FAMILIES["gemma3"]})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    hf = Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(hf, 0.5, 0)
    hf.save_pretrained(tmp_path)  # language_model.*, vision_tower.*, multi_modal_projector.*
    ours = load_our_model(str(tmp_path))
    for tokens, logits in run_paged(ours, _prompts()[:2], num_decode_steps=4, block_size=4):
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch, act", [("llama", "gelu"), ("qwen2", "gelu_new"), ("olmo2", "gelu")])
def test_the_configs_hidden_act_is_the_mlps(tmp_path, arch, act):
    """A dense family's MLP runs the config's `hidden_act` (HF's ACT2FN), not always SiLU."""
    folder = make_tiny_hf_model(arch, tmp_path, hidden_act=act)
    hf = hf_model(folder)
    ours = load_our_model(folder)
    for tokens, logits in run_paged(ours, _prompts()[:2], num_decode_steps=2, block_size=4):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_experts_refuse_another_activation(tmp_path, arch):
    folder = make_tiny_hf_model(arch, tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        load_our_model(folder)
