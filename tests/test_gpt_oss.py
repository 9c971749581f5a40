"""gpt-oss against HF transformers (float32, CPU): a tiny random `GptOssForCausalLM` with
its quirks on: attention sinks, 8-token windows on the layers `layer_types` marks (two of
three), q / k / v / o biases, a biased router over 4 experts (top 2) and biased experts with
the clamped SwiGLU (a small limit, so the clamps bite), yarn rope. One engine: greedy ids
equal HF's for 4 prompts x 24 new tokens, batched with a sampled request, with chunked
prefill and a KV budget small enough to preempt; prefill and decode logits equal HF's
through the in-place C++ kernel and the gather + torch path; the sinks reach both paths.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    hf_generate_greedy,
    hf_logits,
    hf_model,
    load_our_model,
    make_tiny_hf_model,
    run_paged,
)

from pagellm import LLM, SamplingParams
from pagellm.attention import cpu_decode
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.models.registry import kv_sliding_window

SLIDING, FULL = "sliding_attention", "full_attention"


def _hf_reads_swiglu_limit() -> bool:
    """transformers 5.25's GptOss reads `swiglu_limit` from its config; 5.17's (the GPU
    machines') has no such field and clamps at a hard-coded 7.0, whatever the config says."""
    from transformers import GptOssConfig

    return hasattr(GptOssConfig(), "swiglu_limit")


GPT_OSS = dict(
    num_hidden_layers=3,
    layer_types=[SLIDING, FULL, SLIDING],
    sliding_window=8,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    # gate and up pass 2.0 often at these weights: both clamps matter (where HF reads it;
    # else HF's and our 7.0)
    **({"swiglu_limit": 2.0} if _hf_reads_swiglu_limit() else {}),
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    max_position_embeddings=256,
    std=0.3,
)
PROMPT_LENGTHS = (7, 19, 33, 45)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(folder, HF model, one engine in this process)."""
    folder = make_tiny_hf_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), **GPT_OSS)
    hf = hf_model(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        # blocks of 4 tokens, too few for ~200 tokens: preemption; 32-token steps: chunks
        llm = LLM(
            folder,
            dtype="float32",
            block_size=4,
            num_gpu_blocks_override=36,
            max_num_batched_tokens=32,
        )
    yield folder, hf, llm
    llm.shutdown()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_greedy_equals_hf_batched_and_preempted(gpt_oss):
    _, hf, llm = gpt_oss
    prompts = _prompts()
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20)  # a different neighbour
    requests = [{"prompt_token_ids": p} for p in [*prompts, prompts[1][:5]]]
    outputs = llm.generate(requests, [GREEDY] * len(prompts) + [sampled], use_tqdm=False)
    assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        expected = hf_generate_greedy(hf, [prompt], NEW_TOKENS)[0]
        assert out.outputs[0].token_ids == expected, len(prompt)


@pytest.mark.parametrize("in_place", [True, False], ids=["cpp-kernel", "gather"])
def test_logits_equal_hf(gpt_oss, in_place, monkeypatch):
    """Every position's logits, prefilled in 8-token chunks over 4-token blocks, then 4
    decodes; both CPU attention paths (the C++ kernel where it builds)."""
    if in_place and cpu_decode.kernel() is None:
        pytest.skip("no C++ paged attention kernel here")
    monkeypatch.setattr(TorchAttentionBackend, "in_place", in_place)
    folder, hf, _ = gpt_oss
    ours = load_our_model(folder)
    for tokens, logits in run_paged(
        ours, _prompts()[:3], num_decode_steps=4, chunk_size=8, block_size=4
    ):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)


def test_sinks_change_the_logits(gpt_oss):
    """The sinks are not inert at this scale: zeroed, the logits move far past tolerance
    (so the equality above checks them)."""
    folder, hf, _ = gpt_oss
    ours = load_our_model(folder)
    for layer in ours.model.layers:
        layer.self_attn.attn.sinks.data.zero_()
    (tokens, logits), *_ = run_paged(ours, _prompts()[:1], num_decode_steps=1, block_size=4)
    assert (logits - hf_logits(hf, tokens)).abs().max() > 0.1


def test_windows_and_no_block_freeing(gpt_oss):
    """Windows on the sliding layers only; with a full layer no block is freed early."""
    folder, hf, _ = gpt_oss
    ours = load_our_model(folder)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == [8, None, 8]
    assert kv_sliding_window("GptOssForCausalLM", hf.config) is None
    run_paged(ours, _prompts()[:1], num_decode_steps=1, block_size=4)
    assert ours.model._cpu_decoder_built and ours.model.cpu_decoder is None  # layers' forward


def test_dummy_weights_run(gpt_oss):
    """load_format="dummy" draws every parameter (sinks, expert biases) and serves."""
    folder, _, _ = gpt_oss
    ours = load_our_model(folder, load_format="dummy")
    for _, logits in run_paged(ours, _prompts()[:2], num_decode_steps=2, block_size=4):
        assert torch.isfinite(logits).all()


def test_shipped_gpt_oss_20b_config_builds_at_real_size():
    """The shipped config's model, built on `meta`, has gpt-oss-20b's 20.91B parameters
    and its windows (128 tokens on every other layer)."""
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.models import get_model_cls

    config = EngineArgs(model="gpt-oss-20b", load_format="dummy").create_model_config(
        torch.device("cpu")
    )
    assert config.source.kind == "dummy"
    cls = get_model_cls(config.architecture)
    with torch.device("meta"):
        model = cls(config.hf_config, TorchAttentionBackend)
    assert sum(p.numel() for p in model.parameters()) == 20_914_757_184
    assert cls.sliding_windows(config.hf_config) == (128, None) * 12


def test_a_config_without_swiglu_fields_takes_hfs_constants():
    """transformers 5.17's GptOssConfig has no `swiglu_alpha` nor `swiglu_limit` (its model
    hard-codes 1.702 and 7.0), and the checkpoints' config.json files have no alpha: the
    layer takes HF's constants, not an AttributeError."""
    from transformers import GptOssConfig

    from pagellm.models.gpt_oss import GptOssMoE

    class Without(GptOssConfig):  # as 5.17's config reads
        hidden: tuple[str, ...] = ()

        def __getattribute__(self, key):
            if key in type(self).hidden:
                raise AttributeError(key)
            return super().__getattribute__(key)

    for hidden, limit in ((("swiglu_alpha",), 5.0), (("swiglu_alpha", "swiglu_limit"), 7.0)):
        Without.hidden = hidden
        config = Without(**{**GPT_OSS, "swiglu_limit": 5.0})
        with torch.device("meta"):
            moe = GptOssMoE(config)
        assert (moe.experts.activation.alpha, moe.experts.activation.limit) == (1.702, limit)
