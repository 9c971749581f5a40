"""Quantized MoE experts: int4 / int8 checkpoints (GPTQ, AWQ, compressed-tensors; every
expert's projections packed by `wna16_pack.py`, routers float) and fp8 checkpoints whose
experts stay fp8, against HF on a float folder of the same weights dequantized.

On the CPU the experts stay int as the GGUF block kernel's planes (no dequantized copy: a
few rows through the blocks, more through them dequantized per call); act-order experts are
dequantized at load. The CUDA path (experts
stacked as stored, the Triton fused MoE with int or fp8 weights) runs here under Triton's
interpreter: the quantization config is told its device is CUDA while the tensors stay on the
CPU, so the model's Linears and experts take their CUDA kernels (interpreted). Also: tensor-
parallel slices of the stacked experts, random int4 experts (`load_format="dummy"`), clear
errors; `gpu` tests run an engine on CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from model_utils import hf_logits, load_our_model, make_tiny_hf_model, run_paged
from safetensors.torch import load_file, save_file
from wna16_pack import Packing, quantize_folder

from pagellm.distributed.parallel_state import building_rank
from pagellm.quantization import gguf_kernel

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = HAS_TRITON and not torch.cuda.is_available()
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the kernels' K loops have runtime bounds

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
                 hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
CASES = {  # (family, its config, packing)
    "qwen3_moe-gptq-asym-g32": ("qwen3_moe", QWEN3_MOE, Packing("gptq", 4, 32, False)),
    "mixtral-awq-g32": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                        intermediate_size=64, hidden_size=128),
                        Packing("awq", 4, 32, False)),
    "qwen2_moe-shared-ct-asym-g32-actorder": (
        "qwen2_moe", dict(QWEN3_MOE, shared_expert_intermediate_size=96, head_dim=32),
        Packing("compressed-tensors", 4, 32, False, True)),
    "qwen3_moe-gptq_v2-8bit-channel": ("qwen3_moe", QWEN3_MOE, Packing("gptq_v2", 8, -1)),
}  # fmt: skip
PROMPT = [[3, 17, 99, 250, 7]]
LONG_PROMPT = [[3, 17, 99, 250, 7, 41, 12, 88, 5, 130, 64, 9, 201, 77, 31, 140, 2, 60, 19] * 6]
BLOCKS = gguf_kernel.supported()


def _packed(tmp_path, case: str) -> tuple[str, str]:
    """(packed folder, float reference folder)."""
    arch, config, packing = CASES[case]
    folder = make_tiny_hf_model(arch, tmp_path, std=0.1, **config)
    reference = str(tmp_path / "reference")
    quantize_folder(folder, reference, packing)
    return folder, reference


def _hf(reference: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)


def _on_cuda_kernels(monkeypatch, config_cls) -> None:
    """`config_cls.from_model` told its device is CUDA (the tensors stay on the CPU)."""
    original = config_cls.from_model.__func__

    def on_cuda(cls, model_config, device, checkpoint=None):
        return original(cls, model_config, torch.device("cuda"), checkpoint)

    monkeypatch.setattr(config_cls, "from_model", classmethod(on_cuda))


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_logits_equal_the_dequantized_models(case, tmp_path):
    """Experts kept int where the block kernel runs (act-order ones dequantized at load),
    routers never quantized; logits within 1e-4 of HF on the dequantized folder, with int
    weights kept or every layer dequantized (quantization="none"). The long prompt gives
    its experts more rows than the blocks take (dequantized per call), the decode steps few."""
    folder, reference = _packed(tmp_path, case)
    hf = _hf(reference)
    kept_int = BLOCKS and not CASES[case][2].act_order
    for quantization in (None, "none"):
        model = load_our_model(folder, quantization=quantization)
        mlp = model.model.layers[1].mlp
        assert mlp.gate.quant_method is None and mlp.gate.weight.dtype == torch.float32
        assert type(mlp.experts.quant_method).__name__ == "WNA16ExpertsMethod"
        assert "w13_qweight" not in dict(mlp.experts.named_parameters())
        if quantization is None and kept_int:
            assert type(mlp.experts.quantized_experts).__name__ == "WNA16CpuExperts"
            assert mlp.experts._parameters.get("w13") is None
        else:
            assert mlp.experts.w13.dtype == torch.float32
            assert mlp.experts.quantized_experts is None
        for prompt in (PROMPT, LONG_PROMPT):
            fed, got = run_paged(model, prompt, num_decode_steps=3)[0]
            torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


def test_mixtral_experts_under_qwen_names(tmp_path):
    """llm-compressor and GPTQModel unfuse transformers 5's Mixtral experts into Linears named
    as Qwen's (`experts.E.gate_proj` / `up_proj` / `down_proj`, not w1 / w3 / w2) and save them
    so: the same model. (Refused as "no such expert weight" before.)"""
    arch, config, _ = CASES["mixtral-awq-g32"]
    folder = make_tiny_hf_model(arch, tmp_path, std=0.1, **config)
    reference = str(tmp_path / "reference")
    quantize_folder(folder, reference, Packing("gptq", 4, 32, False))
    path = os.path.join(folder, "model.safetensors")
    renames = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    tensors = {}
    for name, tensor in load_file(path).items():
        if ".experts." in name:
            for old, new in renames.items():
                name = name.replace(old, new)
        tensors[name] = tensor
    assert any(".experts.0.gate_proj.qweight" in name for name in tensors)
    save_file(tensors, path)
    fed, got = run_paged(load_our_model(folder), PROMPT, num_decode_steps=3)[0]
    torch.testing.assert_close(got, hf_logits(_hf(reference), fed), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter on a CPU-only machine")
@pytest.mark.parametrize("case", ["qwen3_moe-gptq-asym-g32", "qwen3_moe-gptq_v2-8bit-channel",
                                  "qwen2_moe-shared-ct-asym-g32-actorder"])  # fmt: skip
def test_cuda_path_keeps_int_experts(case, tmp_path, monkeypatch):
    """On CUDA the experts stay int, stacked by expert ([E, 2I, H / 2] uint8 for 4-bit), and
    the fused MoE with int weights gives HF's logits on the dequantized folder; act-order
    experts are dequantized at load (the bf16 kernel), the shared expert's Linears kept."""
    from pagellm.quantization.wna16 import WNA16Config

    folder, reference = _packed(tmp_path, case)
    _on_cuda_kernels(monkeypatch, WNA16Config)
    model = load_our_model(folder)
    layer = model.model.layers[1].mlp.experts
    experts, bits = layer.quantized_experts, CASES[case][2].bits
    if CASES[case][2].act_order:
        assert experts is None and layer.w13.dtype == torch.float32
        shared = model.model.layers[1].mlp.shared_expert.gate_up_proj.packed_weight
        assert type(shared).__name__ == "WNA16GpuWeight"
    else:
        assert type(experts).__name__ == "WNA16GpuExperts" and experts.w13.bits == bits
        assert experts.w13.q.shape == (4, 128, 128 * bits // 8)
        assert experts.w2.q.dtype == torch.uint8 and experts.w2.shape == (4, 128, 64)
    fed, got = run_paged(model, PROMPT, num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(_hf(reference), fed), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter on a CPU-only machine")
@pytest.mark.parametrize("scheme", ["block"])  # per-row scales: test_fused_moe.py
def test_fp8_checkpoint_experts_stay_fp8_on_cuda(scheme, tmp_path, monkeypatch):
    """An fp8 MoE checkpoint (Qwen3-30B-A3B-FP8's layout) on CUDA: its experts stacked in
    fp8 with their scales (128-blocks, or per-tensor as rows), run by the fused MoE with fp8
    weights: HF's logits on the dequantized folder."""
    from test_quantization_fp8 import _fp8_moe_checkpoint

    from pagellm.quantization.fp8 import Fp8Config

    folder, reference = _fp8_moe_checkpoint(tmp_path, scheme)
    _on_cuda_kernels(monkeypatch, Fp8Config)
    model = load_our_model(folder)
    experts = model.model.layers[0].mlp.experts.quantized_experts
    assert type(experts).__name__ == "Fp8GpuExperts"
    assert experts.w13.q.dtype == torch.float8_e4m3fn and experts.w13.q.shape == (4, 256, 128)
    assert experts.w13.scales.shape == ((4, 2, 1) if scheme == "block" else (4, 256))
    fed, got = run_paged(model, PROMPT, num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(_hf(reference), fed), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter on a CPU-only machine")
def test_fp8_at_load_quantizes_the_experts(tmp_path):
    """quantization="fp8" on a float MoE model (CUDA): the experts quantized per row after
    loading (fp8 within its rounding of the float weights), the layer the torch path on those
    weights."""
    from pagellm.layers.moe import experts_torch, select_experts
    from pagellm.quantization.fp8 import Fp8Config

    folder = make_tiny_hf_model("qwen3_moe", tmp_path, std=0.1, **QWEN3_MOE)
    layer = load_our_model(folder).model.layers[0].mlp.experts
    floats = layer.w13.clone(), layer.w2.clone()
    method = Fp8Config(None, [], False, torch.float32).experts_method("experts", layer)
    method.process_weights_after_loading(layer)
    stacks = layer.quantized_experts.w13, layer.quantized_experts.w2
    assert all(s.q.dtype == torch.float8_e4m3fn for s in stacks) and layer.w13 is None
    deq = [s.q.float() * s.scales[..., None] for s in stacks]
    for got, want in zip(deq, floats):
        torch.testing.assert_close(got, want, rtol=2**-3, atol=1e-6)  # e4m3: 3 mantissa bits
    x = torch.randn(5, 128)
    weights, ids = select_experts(torch.randn(5, 4), 2, True)
    want = experts_torch(x, *deq, weights, ids)
    torch.testing.assert_close(layer.quantized_experts(x, weights, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case", ["qwen3_moe-gptq-asym-g32", "qwen2_moe-shared-ct-asym-g32-actorder"]
)
def test_each_rank_holds_its_experts_rows_and_groups(case, tmp_path):
    """Two ranks: each expert's gate / up rows and down columns (whole groups; act-order: all
    the scales and its columns' g_idx) of the one-rank model, dequantized."""
    folder, _ = _packed(tmp_path, case)
    full = load_our_model(folder, quantization="none").model.layers[1].mlp.experts
    for rank in range(2):
        with building_rank(rank, 2):
            shard = load_our_model(folder, quantization="none").model.layers[1].mlp.experts
        gate, up = full.w13.chunk(2, dim=1)
        assert torch.equal(shard.w13, torch.cat([gate.chunk(2, 1)[rank], up.chunk(2, 1)[rank]], 1))
        assert torch.equal(shard.w2, full.w2.chunk(2, dim=2)[rank])


def test_split_inside_a_group_and_bad_tensors_are_clear_errors(tmp_path):
    folder, _ = _packed(tmp_path, "qwen3_moe-gptq-asym-g32")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:  # 64 / 2 ranks = 32 columns: groups of 64 split
        f.write(text.replace('"group_size": 32', '"group_size": 64'))
    with building_rank(0, 2), pytest.raises(ValueError, match=(
        "tensor parallel: the experts' 64 intermediate columns split into 32 per rank, not a "
        "multiple of the checkpoint's group_size 64")):  # fmt: skip
        load_our_model(folder)
    folder, _ = _packed(tmp_path / "b", "qwen3_moe-gptq-asym-g32")
    state_path = os.path.join(folder, "model.safetensors")
    state = load_file(state_path)
    name = "model.layers.1.mlp.experts.2.down_proj.qweight"
    state[name] = state[name][:-1].contiguous()
    save_file(state, state_path)
    with pytest.raises(ValueError, match=rf"{name}: expected GPTQ int32 qweight \[K / 8, N\]"):
        load_our_model(folder)
    del state[name]
    state[name.replace("qweight", "weight")] = torch.zeros(128, 64)
    save_file(state, state_path)
    with pytest.raises(ValueError, match="down_proj.weight.*a float weight where"):
        load_our_model(folder)


def test_dummy_int4_experts(tmp_path, monkeypatch):
    """load_format="dummy" with quantization="gptq" on a MoE config without a
    quantization_config: random int4 experts in groups of 128 (CUDA: kept int, stacked; the
    CPU: each expert's blocks, or dequantized without the block kernel), each group of a row
    on 16 levels."""
    from pagellm.quantization.wna16 import WNA16Config

    folder = make_tiny_hf_model("qwen3_moe", tmp_path, **QWEN3_MOE)
    experts = load_our_model(folder, load_format="dummy", quantization="gptq").model.layers[0]
    fused = experts.mlp.experts
    if BLOCKS:  # [4, 128, 128] as the blocks hold it: one group of 128 a row
        w13 = torch.stack([gguf_kernel.dequantize_into_scratch(w.planes, torch.float32).clone()
                           for w in fused.quantized_experts.w13])  # fmt: skip
    else:
        w13 = fused.w13
    assert max(len(row.unique()) for row in w13.reshape(-1, 128)) <= 16
    assert 0.01 < float(w13.std()) < 0.03  # the config's initializer_range, 0.02
    if INTERPRETED:
        _on_cuda_kernels(monkeypatch, WNA16Config)
        layer = load_our_model(folder, load_format="dummy", quantization="gptq").model.layers[0]
        stack = layer.mlp.experts.quantized_experts.w13
        assert stack.q.shape == (4, 128, 64) and stack.group == 128


@pytest.mark.gpu
def test_int4_moe_engine_on_cuda_agrees_with_dequantized(tmp_path):
    """A packed tiny Qwen3-MoE on CUDA (int experts in the fused MoE kernel, int Linears)
    against quantization="none" (bf16 at load): greedy continuations mostly agree."""
    from pagellm import LLM, SamplingParams

    folder, _ = _packed(tmp_path, "qwen3_moe-gptq-asym-g32")
    prompts = [{"prompt_token_ids": [3, 17, 99, 250 + i]} for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for quantization in (None, "none"):
        with LLM(model=folder, quantization=quantization, max_model_len=256) as llm:
            runs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(a[:4] == b[:4] for a, b in zip(runs[None], runs["none"]))
    assert same >= 12, same
