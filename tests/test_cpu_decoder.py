"""The decoder layers in one C++ call a step (`pagellm.layers.cpu_decoder`) give the Python
layers' logits bit for bit: the same kernels in the same order. Mixed batches of prefill
chunks and decodes in random order, over the variants the loop serves (bf16 and float32
panels, biases, Qwen3's q/k norms, sliding windows, GGUF blocks and panels on either side
of a layer's row limit), and the cases it leaves to the Python layers."""

from __future__ import annotations

import pytest
import torch
from model_utils import load_our_model, make_tiny_hf_model, run_paged, write_tiny_gguf

from pagellm.kernels import cpu_gemm, panel_gemm
from pagellm.layers import cpu_decoder
from pagellm.models.llama import LlamaDecoderLayer
from pagellm.quantization import gguf_kernel

pytestmark = pytest.mark.skipif(
    cpu_decoder._entry() is None, reason="the C++ decoder loop needs a compiler (x86)"
)
needs_bf16_kernel = pytest.mark.skipif(
    not panel_gemm.supported(), reason="bf16 panels need AVX512-BF16"
)
needs_f32_kernel = pytest.mark.skipif(
    not panel_gemm.supported(torch.float32), reason="float32 panels need AVX-512 or AVX2 + FMA"
)


@pytest.fixture
def bf16_kernel_plan(monkeypatch):
    """The GEMM plan with our kernels (the loop's GEMMs), restored afterwards."""
    monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "1")
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "pagellm")
    cpu_gemm.cpu_gemm_plan.cache_clear()
    yield
    cpu_gemm.cpu_gemm_plan.cache_clear()


def _packed(path: str, dtype: torch.dtype, **kwargs):
    model = load_our_model(path, dtype=dtype, **kwargs)
    model.prepack_cpu_weights(batch_hint=16)  # as the runner does
    return model


def _both_ways(model, prompts, **kwargs) -> int:
    """Run the same schedule with the loop and with the Python layers; assert equal logits;
    return how many steps the loop ran."""
    runs = {"n": 0}
    model.model.cpu_decoder = cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer)
    model.model._cpu_decoder_built = True
    assert model.model.cpu_decoder is not None
    run = model.model.cpu_decoder.run

    def counted(*args):
        runs["n"] += 1
        return run(*args)

    model.model.cpu_decoder.run = counted
    looped = run_paged(model, prompts, **kwargs)
    model.model.cpu_decoder = None
    plain = run_paged(model, prompts, **kwargs)
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(looped, plain, strict=True):
        assert tokens_a == tokens_b
        assert torch.equal(logits_a, logits_b)
    return runs["n"]


PROMPTS = [[5, 9, 33, 2, 71, 8, 100, 41, 3], [7] * 23, [60, 61, 62], list(range(40, 75))]


@needs_bf16_kernel
@pytest.mark.parametrize(
    "arch, overrides",
    [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", dict(attention_bias=True,
     mlp_bias=True)), ("mistral", dict(sliding_window=8))],
    ids=["llama", "qwen2-bias", "qwen3-qk-norm", "llama-all-biases", "mistral-window"],
)  # fmt: skip
def test_loop_equals_the_layers_bf16(tmp_path, bf16_kernel_plan, arch, overrides):
    model = _packed(make_tiny_hf_model(arch, tmp_path, std=0.3, **overrides), torch.bfloat16)
    steps = _both_ways(model, PROMPTS, num_decode_steps=5, chunk_size=7, stagger=True,
                       shuffle=True)  # fmt: skip
    assert steps > 5


@needs_f32_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loop_equals_the_layers_float32(tmp_path, bf16_kernel_plan, arch):
    model = _packed(make_tiny_hf_model(arch, tmp_path, std=0.3), torch.float32)
    assert _both_ways(model, PROMPTS, num_decode_steps=4, chunk_size=9, shuffle=True) > 4


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    folder = make_tiny_hf_model("llama", tmp, std=0.3)
    return {qt: write_tiny_gguf(folder, str(tmp / f"{qt}.gguf"), qt) for qt in ("Q4_1", "Q8_0")}


@pytest.mark.skipif(
    not gguf_kernel.supported(), reason="the GGUF block kernel needs AVX-512 or AVX2"
)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_loop_equals_the_layers_gguf_float32(tiny_gguf, qtype, monkeypatch):
    """float32: GGUF blocks up to their 8 rows in the loop; larger steps (the prefill of
    every prompt at once) take the Python layers and the dense copy (in MKL / oneDNN)."""
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "onednn")
    cpu_gemm.cpu_gemm_plan.cache_clear()
    try:
        model = _packed(tiny_gguf[qtype], torch.float32, quantization="gguf")
    finally:
        cpu_gemm.cpu_gemm_plan.cache_clear()
    decoder = cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer)
    assert decoder.block_rows == 8 and decoder.panel_rows_limit == 8
    steps = _both_ways(model, PROMPTS, num_decode_steps=4, chunk_size=2)
    assert steps >= 4


@needs_bf16_kernel
@pytest.mark.skipif(
    not gguf_kernel.supported(), reason="the GGUF block kernel needs AVX-512 or AVX2"
)
def test_loop_equals_the_layers_gguf_bf16(tiny_gguf, bf16_kernel_plan, monkeypatch):
    """bf16: blocks for steps of up to their row limit (2 here), the dense copy's panels for
    larger ones, both inside the loop."""
    monkeypatch.setenv("PAGELLM_CPU_QUANT_MAX_ROWS", "2")
    model = _packed(tiny_gguf["Q4_1"], torch.bfloat16, quantization="gguf")
    decoder = cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer)
    assert decoder.block_rows == 2 and decoder.panel_rows_limit > 1 << 40
    # one prompt alone (1-row decodes: blocks), then all of them (panels)
    assert _both_ways(model, PROMPTS[:1], num_decode_steps=3) == 4
    assert _both_ways(model, PROMPTS, num_decode_steps=3, chunk_size=5, stagger=True) > 4


@pytest.mark.skipif(
    not gguf_kernel.supported(), reason="the GGUF block kernel needs AVX-512 or AVX2"
)
@pytest.mark.parametrize("int8", ["0", "1"])
def test_loop_equals_the_layers_gptq_act_order(tmp_path, int8, monkeypatch):
    """An act-order GPTQ checkpoint's blocks read x gathered by the layer's column order, in
    the loop as in the Python layers (before, the loop took the dense copy: other sums, and
    PAGELLM_CPU_INT8_ACTIVATIONS ignored); with int8 activations too."""
    from wna16_pack import Packing, quantize_folder

    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "onednn")
    monkeypatch.setenv("PAGELLM_CPU_INT8_ACTIVATIONS", int8)
    folder = make_tiny_hf_model("qwen2", tmp_path, std=0.1, hidden_size=128,
                                intermediate_size=256)  # fmt: skip
    quantize_folder(folder, str(tmp_path / "float"), Packing("gptq", 4, 32, False, True))
    cpu_gemm.cpu_gemm_plan.cache_clear()
    try:
        model = _packed(folder, torch.float32)
    finally:
        cpu_gemm.cpu_gemm_plan.cache_clear()
    assert model.model.layers[0].self_attn.qkv_proj.packed_weight.perm is not None
    decoder = cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer)
    assert decoder.block_rows == 8
    assert _both_ways(model, PROMPTS, num_decode_steps=4, chunk_size=2) >= 4


def test_what_the_loop_leaves_to_the_layers(tmp_path, monkeypatch):
    """float32 GEMMs in MKL / oneDNN, Gemma's own layers, fp8 caches and
    PAGELLM_CPU_DECODER_LOOP=0 take the Python layers."""
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "onednn")
    cpu_gemm.cpu_gemm_plan.cache_clear()
    try:
        model = _packed(make_tiny_hf_model("llama", tmp_path), torch.float32)
    finally:
        monkeypatch.delenv("PAGELLM_CPU_FP32_GEMM")
        cpu_gemm.cpu_gemm_plan.cache_clear()
    assert cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer) is None
    gemma = load_our_model(make_tiny_hf_model("gemma2", tmp_path), dtype=torch.bfloat16)
    assert not hasattr(gemma.model, "cpu_decoder") or gemma.model.cpu_decoder is None
    if panel_gemm.supported():
        monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "1")
        cpu_gemm.cpu_gemm_plan.cache_clear()
        try:
            bf16 = _packed(make_tiny_hf_model("llama", tmp_path / "b"), torch.bfloat16)
        finally:
            cpu_gemm.cpu_gemm_plan.cache_clear()
        decoder = cpu_decoder.CpuDecoder.build(bf16.model, LlamaDecoderLayer)
        assert decoder is not None
        hidden = torch.zeros(3, decoder.hidden, dtype=torch.bfloat16)
        fp8 = [torch.zeros(2, 4, 16, 2, 16, dtype=torch.float8_e4m3fn)]
        assert not decoder.runs(hidden, fp8, object())
    monkeypatch.setenv("PAGELLM_CPU_DECODER_LOOP", "0")
    cpu_decoder._entry.cache_clear()
    try:
        assert cpu_decoder._entry() is None
    finally:
        monkeypatch.delenv("PAGELLM_CPU_DECODER_LOOP")
        cpu_decoder._entry.cache_clear()
