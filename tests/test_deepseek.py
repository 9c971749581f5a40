"""DeepSeek V2 and V3 (multi-head latent attention, grouped top-k MoE with shared experts)
against HF transformers on the CPU in float32: prefill logits through the latent paged cache
(chunked prefill, staggered and shuffled batches: the expanded form for prefill chunks, the
absorbed form for decodes), and greedy ids from one engine per family with requests batched,
chunked and preempted. Also: the KV budget counts one latent row a token, transformers 5's
fused expert tensors load like per-expert ones, and the shipped DeepSeek-V2-Lite config
builds at its real shape.

Quirks switched on: V2 without a q LoRA (V2-Lite), dense first layer, two shared experts (or
none), softmax routing (greedy, and group-limited with a routed scaling factor) and yarn with
mscale / mscale_all_dim (its softmax scale adjusted, HF's `yarn_apply_mscale`); V3 with a q
LoRA, sigmoid routing with a random `e_score_correction_bias`, groups, `norm_topk_prob` and
`routed_scaling_factor`, interleaved and not interleaved rotary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from model_utils import (
    TINY_CONFIG,
    _randomize,
    assert_fused_experts_load_alike,
    hf_logits,
    load_our_model,
    run_paged,
)
from safetensors.torch import save_file
from test_moe import one_thread  # noqa: F401 (autouse: one torch thread for this module)
from transformers import AutoConfig, AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.layers.deepseek_moe import DeepseekMoE

# HF builds a model without shared experts with empty projections, and says so
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
MLA = dict(
    num_key_value_heads=4,  # HF's MLA expands every head's K / V: as many as query heads
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    num_hidden_layers=3,  # dense, MoE, MoE
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    mscale=1.0,
    mscale_all_dim=0.8,
)
FAMILIES = {
    "deepseek_v2": dict(MLA, q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    "deepseek_v2_grouped": dict(
        MLA,
        model_type="deepseek_v2",
        q_lora_rank=None,
        n_shared_experts=0,  # HF saves empty shared projections: none built, none loaded
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        rope_parameters=YARN,
    ),
    "deepseek_v3": dict(
        MLA,
        q_lora_rank=24,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
    ),
    "deepseek_v3_plain_rope": dict(
        MLA,
        model_type="deepseek_v3",
        q_lora_rank=24,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        rope_interleave=False,
    ),
}
BLOCK_SIZE, NUM_BLOCKS = 4, 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_tiny_deepseek(name: str, folder: Path, **overrides) -> str:
    """A random HF DeepSeek model saved under `folder` (V3's score-correction bias, a buffer
    HF leaves at zero, random too)."""
    kwargs = {**TINY_CONFIG, **FAMILIES[name], **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type", name), **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, 0.3, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.2)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, HF model, one in-process engine) per family."""
    folder = make_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            folder,
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=NUM_BLOCKS * _latent_block_bytes(hf.config),
            max_num_batched_tokens=32,
        )
    yield folder, hf, llm
    llm.shutdown()


def _latent_block_bytes(config) -> int:
    """A block of every layer's latent cache, float32: one row of R + P a token."""
    row = config.kv_lora_rank + config.qk_rope_head_dim
    return BLOCK_SIZE * config.num_hidden_layers * row * 4


def _prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in lengths]


def test_logits_equal_hf_through_the_latent_cache(family):
    folder, hf, _ = family
    ours = load_our_model(folder)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in ours.model.layers] == [
        False,
        True,
        True,
    ]
    prompts = _prompts(7, 19, 33, 1)
    results = run_paged(
        ours, prompts, num_decode_steps=5, chunk_size=6, block_size=4, stagger=True, shuffle=True
    )
    for tokens, logits in results:
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_ids_equal_hf_batched_chunked_and_preempted(family):
    _, hf, llm = family
    prompts = _prompts(5, 17, 33, 24, seed=2)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=12)  # a different neighbour
    requests = [{"prompt_token_ids": p} for p in [*prompts, prompts[1][:6]]]
    outputs = llm.generate(requests, [GREEDY] * len(prompts) + [sampled], use_tqdm=False)
    assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_v2_mlp_bias_and_moe_layer_freq_as_hf_reads_them(tmp_path):
    """V2's `mlp_bias` (biases on the dense MLP and the shared experts) and a
    `moe_layer_freq` of 2, which HF ignores (experts on every layer from
    `first_k_dense_replace`): the logits of HF's checkpoint."""
    folder = make_tiny_deepseek("deepseek_v2", tmp_path, mlp_bias=True, moe_layer_freq=2)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_our_model(folder)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in ours.model.layers] == [
        False,
        True,
        True,
    ]
    for tokens, logits in run_paged(ours, _prompts(9, 4), num_decode_steps=3, block_size=4):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)


def test_an_activation_the_experts_cannot_run_is_refused(tmp_path):
    folder = make_tiny_deepseek("deepseek_v2", tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act .gelu. is not supported"):
        load_our_model(folder)


@pytest.mark.parametrize("overrides, words", [
    (dict(n_group=3), "n_group=3 must divide the 8 routed experts into groups of at least 2"),
    (dict(n_group=8, topk_group=2), "groups of at least 2"),  # V3 scores a group by its top 2
    (dict(topk_group=5), "topk_group=5 must be 1 to n_group=4"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9: a token routes to 1 to 8 experts"),
])  # fmt: skip
def test_routing_a_config_cannot_do_is_refused_at_load(tmp_path, overrides, words):
    """Routing HF fails on at its first forward (groups not dividing the experts, more kept
    groups than groups, more experts a token than there are) is a clear error at load."""
    folder = make_tiny_deepseek("deepseek_v3", tmp_path, **overrides)
    with pytest.raises(ValueError, match=words):
        load_our_model(folder)


def test_v3_router_under_v2_name_is_refused(tmp_path):
    folder = make_tiny_deepseek("deepseek_v2", tmp_path, topk_method="noaux_tc")
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is V3's router"):
        load_our_model(folder)


def test_kv_budget_counts_one_latent_row_a_token(family):
    """The budget buys exactly NUM_BLOCKS blocks of latent rows (per-head K and V would have
    bought H * (dn + P + dv) / (R + P) = 4.4x fewer)."""
    _, _, llm = family
    assert llm.llm_engine.call_utility("get_num_kv_blocks") == NUM_BLOCKS


@pytest.mark.parametrize("family", ["deepseek_v3"], indirect=True)
def test_fused_expert_tensors_load_like_per_expert_ones(family, tmp_path):
    """transformers 5's state dict stacks a layer's experts (`experts.gate_up_proj`): a
    checkpoint written from it loads to the same parameters, routers in float32."""
    folder, hf, _ = family
    fused = assert_fused_experts_load_alike(folder, hf, tmp_path)
    bias = fused["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0


@pytest.mark.parametrize("family", ["deepseek_v3"], indirect=True)
def test_mtp_layers_of_a_v3_checkpoint_are_skipped(family, tmp_path):
    """DeepSeek-V3's checkpoints carry their multi-token-prediction layer as
    `model.layers.<num_hidden_layers>.*`: the main model loads, the same parameters."""
    import shutil

    from safetensors.torch import load_file

    folder, hf, _ = family
    mtp = Path(shutil.copytree(folder, tmp_path / "with-mtp"))
    state = load_file(mtp / "model.safetensors")
    n = hf.config.num_hidden_layers
    state[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    state[f"model.layers.{n}.mlp.experts.0.gate_proj.weight"] = torch.zeros(24, 64)
    save_file(state, str(mtp / "model.safetensors"))
    with_mtp = dict(load_our_model(str(mtp)).named_parameters())
    for name, param in load_our_model(folder).named_parameters():
        assert torch.equal(with_mtp[name], param), name


def test_shipped_deepseek_v2_lite_config_plans_latent_rows():
    """DeepSeek-V2-Lite's shape on `meta`: 27 layers of 576-wide latent rows (bf16: 31,104
    bytes a token, against 27 x 16 heads x 2 x 192 x 2 for per-head K and V)."""
    from pagellm import EngineArgs
    from pagellm.engine.plan_model import read_model

    args = EngineArgs(model="deepseek-v2-lite", load_format="dummy", dtype="bfloat16")
    facts = read_model(args, torch.device("cpu"))
    assert facts.kv_bytes_per_token == 27 * (512 + 64) * 2
    # V3's layers cut to 4 (128 heads, q-LoRA, 256 experts in 8 groups): one row a token too
    args = EngineArgs(model="deepseek-v3-4layer", load_format="dummy", dtype="bfloat16")
    assert read_model(args, torch.device("cpu")).kv_bytes_per_token == 4 * (512 + 64) * 2
    assert facts.config.architecture == "DeepseekV2ForCausalLM"
    assert 30e9 < facts.weight_bytes < 33e9  # 15.7B parameters in bf16


@pytest.mark.parametrize("family", ["deepseek_v2"], indirect=True)
def test_fp8_kv_cache_is_refused_in_our_words(family):
    from pagellm import EngineArgs

    folder, _, _ = family
    args = EngineArgs(model=folder, dtype="float32", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"not supported for latent attention \(MLA\)"):
        args.create_engine_config()


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's storage: fp8 e4m3 values and a float32 scale a 128 x 128 block."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scale = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() / 448
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_fp8_block_checkpoint_loads_dequantized_on_the_cpu(tmp_path):
    """A V3 checkpoint stored as DeepSeek-V3's is (every projection, kv_b_proj and the experts
    included, fp8 in 128 x 128 blocks; routers and norms not): our logits are HF's on the
    dequantized weights (a float copy of the folder: HF would load fp8 as bf16 here)."""
    import json
    import shutil

    from safetensors.torch import load_file

    from pagellm.layers.mla import LatentProjection
    from pagellm.quantization.fp8 import Fp8Weight, dequantize_fp8

    sizes = dict(intermediate_size=128, moe_intermediate_size=128)  # whole 128-row blocks
    folder = Path(make_tiny_deepseek("deepseek_v3", tmp_path / "fp8", **sizes))
    reference = Path(shutil.copytree(folder, tmp_path / "reference"))
    state = load_file(folder / "model.safetensors")
    dequantized = {}
    for name in [n for n in state if n.endswith(("proj.weight", "proj_with_mqa.weight"))]:
        q, scale = _fp8_blocks(state[name])
        state[name], state[name.replace(".weight", ".weight_scale_inv")] = q, scale
        dequantized[name] = dequantize_fp8(q, scale)
    save_file(state, str(folder / "model.safetensors"))
    save_file(
        load_file(reference / "model.safetensors") | dequantized,
        str(reference / "model.safetensors"),
    )
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    ours = load_our_model(str(folder))
    kv_b = ours.model.layers[1].self_attn.kv_b_proj
    expected = dequantized["model.layers.1.self_attn.kv_b_proj.weight"]
    assert torch.equal(kv_b.dense_weight(torch.float32), expected)
    # on CUDA the fp8 method keeps the values and block scales (`Fp8Weight`), no float weight
    stem = "model.layers.1.self_attn.kv_b_proj"
    cuda_like = LatentProjection(kv_b.in_features, kv_b.out_features, bias=False)
    cuda_like.packed_weight = Fp8Weight(state[f"{stem}.weight"], state[f"{stem}.weight_scale_inv"])
    cuda_like.weight = None
    assert torch.equal(cuda_like.dense_weight(torch.float32), expected)
    ((tokens, logits),) = run_paged(ours, _prompts(9), num_decode_steps=2, block_size=4)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)
