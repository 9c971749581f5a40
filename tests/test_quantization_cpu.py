"""Quantized weights on the CPU: torch's int4 / int8 kernels against dequantized reference
matmuls (their zero-point convention, bfloat16 scales and activations), GGUF Q4_0 / Q4_1
blocks mapped exactly, the GGUF block kernel (Q4_0 / Q4_1 / Q8_0, float32 and bfloat16
activations) against the dequantized weights, the dispatch by row count, a quantized
model's logits against the same model dequantized, and which `quantization` values are
accepted where."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_utils import load_our_model, make_tiny_hf_model, write_tiny_gguf

from pagellm import EngineArgs
from pagellm.loader.gguf_file import GGUFTensor
from pagellm.quantization import cpu_int, gguf_kernel, resolve_quantization
from pagellm.quantization.cpu_int import (
    CpuQuantizedWeight,
    dequantize_int4,
    int4_scales_zeros,
    int4_weight,
    int8_weight,
    quantize_int4,
    quantize_int8,
)
from pagellm.quantization.gguf_cpu import GGUFBlockWeight
from pagellm.quantization.gguf_dequant import decode_blocks, dequantize, q4_parts
from pagellm.utils import cpuinfo_flags

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_int_kernels = pytest.mark.skipif(
    not cpu_int.cpu_int_supported(), reason="torch's int4 / int8 kernels need AVX512-BF16"
)
needs_block_kernel = pytest.mark.skipif(
    not gguf_kernel.supported(),
    reason="the GGUF block kernel needs AVX-512 or AVX2, and a compiler",
)


def _bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T with x rounded to bfloat16 (what the int kernels see), in float32."""
    return x.bfloat16().float() @ w.t()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


# ---------------------------------------------------------------- kernels


def test_int4_kernel_zero_point_convention():
    """w = q * d + m (Q4_1's form) is scale d, zero m + 8 d: the kernel computes
    (q - 8) * scale + zero, with scale and zero rounded to bfloat16."""
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    m = -torch.rand(n, k // 32, generator=gen) * 0.1
    exact = dequantize_int4(q, d, m)
    weight = int4_weight(q, d, m, exact)
    x = torch.randn(3, k, generator=gen)
    sz = int4_scales_zeros(d, m).float().transpose(0, 1)  # [N, K / 32, 2] as the kernel has it
    as_rounded = ((q.view(n, -1, 32).float() - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)
    _close(weight(x), _bf16_matmul(x, as_rounded), 1e-2)  # bf16 output rounding
    _close(weight(x), x @ exact.t(), 3e-2)  # plus the bf16 scales / activations


def test_int4_quantize_round_trip():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen)
    q, scale, low = quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15
    err = (dequantize_int4(q, scale, low) - w).abs().view(64, 3, 32)
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    x = torch.randn(2, 96, generator=gen)
    deq = dequantize_int4(q, scale, low)
    _close(int4_weight(q, scale, low, deq)(x), x @ deq.t(), 3e-2)


def test_int8_round_trip_and_kernel():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(80, 64, generator=gen)
    q, scale = quantize_int8(w)
    deq = q.float() * scale[:, None]
    assert ((deq - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    x = torch.randn(4, 64, generator=gen)
    _close(int8_weight(q, scale, torch.float32)(x), x @ deq.t(), 1e-2)


def test_rows_are_independent_and_large_batches_use_the_dense_copy():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=gen)
    q, scale, low = quantize_int4(w, 32)
    deq = dequantize_int4(q, scale, low)
    weight = int4_weight(q, scale, low, deq)
    assert isinstance(weight, CpuQuantizedWeight) and weight.max_rows == 4
    x = torch.randn(5, 64, generator=gen)
    four = weight(x[:4])
    assert torch.equal(four[2:3], weight(x[2:3]))  # a row's result does not depend on M
    assert not torch.allclose(four, x[:4] @ deq.t(), rtol=0, atol=1e-6)  # bf16 activations
    bias = torch.randn(64, generator=gen)
    torch.testing.assert_close(weight(x, bias), F.linear(x, deq, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_map_exactly(qtype):
    """q4_parts' (q, d, m) give back the dequantized weights bit for bit."""
    x = np.random.default_rng(4).standard_normal((16, 64)).astype(np.float32)
    data = gguf.quants.quantize(x, qtype)
    blocks = torch.from_numpy(data).reshape(-1, data.shape[1] // 2)
    q, d, m = q4_parts(blocks, qtype)
    ref = dequantize(GGUFTensor("w", qtype, x.shape, data)).view(-1, 32)
    assert torch.equal(q.float() * d + m, ref) or qtype == Q.Q4_0  # Q4_0: (q - 8) * d
    torch.testing.assert_close(q.float() * d + m, ref, rtol=0, atol=1e-6)
    assert torch.equal(decode_blocks(blocks, qtype), ref)


def _random_blocks(qtype, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k / 32 * bytes] blocks of random bytes with sane fp16 scales (and mins)."""
    size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // 32, size), generator=gen, dtype=torch.uint8)
    halves = (torch.rand(n * k // 32, 2, generator=gen) * 0.02 - 0.005).half()
    blocks[:, :2] = halves[:, :1].view(torch.uint8)
    if qtype == Q.Q4_1:
        blocks[:, 2:4] = halves[:, 1:].view(torch.uint8)
    return blocks.view(n, -1)


@needs_block_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("k", [256, 1184])
def test_block_gemm_matches_the_dequantized_weights(qtype, k):
    """float32: the dequantized matmul up to float32 rounding; bfloat16 x: the same on the
    bf16 values, the output rounded once; rows 1..8 a call, more in chunks, with a bias; N
    not a multiple of the kernel's 16-row tasks; 8 blocks a row, and 37 (an odd count: the
    block pairs' tail; more than two vectors of block scales and offsets)."""
    n = 50
    blocks = _random_blocks(qtype, n, k, seed=7)
    w = decode_blocks(blocks.reshape(-1, blocks.shape[1] // (k // 32)), qtype).view(n, k)
    planes = gguf_kernel.BlockPlanes.from_blocks(blocks, qtype)
    assert torch.equal(_planes_to_float(planes), w)  # the planes hold the file's values
    bias = torch.randn(n)
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = F.linear(x.double(), w.double(), bias.double())
        got = gguf_kernel.block_gemm(x, planes, bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
        got = gguf_kernel.block_gemm(x.bfloat16(), planes)
        want = F.linear(x.bfloat16().double(), w.double())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max())


def _planes_to_float(p: gguf_kernel.BlockPlanes) -> torch.Tensor:
    n, k = p.shape
    if p.m is None:  # Q8
        q = p.qs.float().view(n, -1, 32)
    else:
        nib = p.qs.view(n, -1, 16)
        q = torch.cat([nib & 0x0F, nib >> 4], -1).float()
    w = q * p.d.float()[..., None] + (0.0 if p.m is None else p.m.float()[..., None])
    return w.view(n, k)


@needs_block_kernel
def test_block_gemm_rows_are_independent():
    """A row's result does not depend on the rows beside it (batched decodes are each the
    lone request's), and bad shapes are refused."""
    for x in (torch.randn(6, 128), torch.randn(6, 160).bfloat16()):  # 4 blocks; 5 (odd)
        planes = gguf_kernel.BlockPlanes.from_blocks(
            _random_blocks(Q.Q4_1, 40, x.shape[1], 8), Q.Q4_1
        )
        together = gguf_kernel.block_gemm(x, planes)
        for i in range(6):
            assert torch.equal(gguf_kernel.block_gemm(x[i : i + 1], planes)[0], together[i])
    with pytest.raises(ValueError, match="against weight"):
        gguf_kernel.block_gemm(torch.randn(1, 96), planes)
    with pytest.raises(ValueError, match="float16 against"):
        gguf_kernel.block_gemm(torch.randn(1, 128, dtype=torch.float16), planes)


needs_int8_dots = pytest.mark.skipif(
    not gguf_kernel.supported()
    or not {"avx512_vnni", "avx512bw", "avx512vl", "avx512dq"} <= cpuinfo_flags(),
    reason="int8 activations need AVX512-VNNI",
)


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's Q8_0 rounds it (per row and block of 32: d = max|x| / 127, q =
    x * (127 / max|x|) to nearest even), back in float64: what the int8 path multiplies."""
    rows, k = x.shape
    xb = x.float().view(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q.double() * (amax / 127.0).double()).view(rows, k)


@needs_int8_dots
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, "gptq"])
@pytest.mark.parametrize("k", [96, 1184])
def test_int8_activations_are_x_rounded_to_int8_blocks(qtype, k):
    """PAGELLM_CPU_INT8_ACTIVATIONS: the product of the dequantized weights with x rounded to
    int8 blocks, up to float32 rounding (not the exact product: about 1e-3 off); rows 1..8,
    bf16 x, a bias, an all-zero block, odd block counts (3, 37: the pairs' tail); Q8 weights
    keep the exact products."""
    n, gen = 40, torch.Generator().manual_seed(3)
    if qtype == "gptq":  # float32 offsets (-zero * scale), the GPTQ / AWQ layout
        qs = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
        m = -torch.randint(0, 16, (n, k // 32), generator=gen) * d.float()
        exact = gguf_kernel.BlockPlanes(qs, d, m, int8_activations=False)
        rounded = gguf_kernel.BlockPlanes(qs, d, m, int8_activations=True)
    else:
        blocks = _random_blocks(qtype, n, k, seed=9)
        exact = gguf_kernel.BlockPlanes.from_blocks(blocks, qtype)
        rounded = gguf_kernel.BlockPlanes.from_blocks(blocks, qtype)
        rounded = gguf_kernel.BlockPlanes(rounded.qs, rounded.d, rounded.m, int8_activations=True)
    assert rounded._args[0] == exact._args[0] | gguf_kernel.INT8_ACTIVATIONS
    w = _planes_to_float(exact).double()
    bias = torch.randn(n, generator=gen)
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, k, generator=gen) * torch.rand(rows, k, generator=gen) * 4
        x[0, 32:64] = 0
        scale = (x.double().abs() @ w.abs().t()).max()  # the sums' magnitude
        got = gguf_kernel.block_gemm(x, rounded, bias).double()
        want = F.linear(_int8_blocks(x), w, bias.double())
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * scale)
        off = (got - F.linear(x.double(), w, bias.double())).abs().max()
        assert 1e-5 * scale < off < 1e-2 * scale  # rounded: near, but not the exact product
        got = gguf_kernel.block_gemm(x.bfloat16(), rounded).double()
        want = F.linear(_int8_blocks(x.bfloat16()), w)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max())
    q8 = gguf_kernel.BlockPlanes.from_blocks(_random_blocks(Q.Q8_0, n, k, seed=9), Q.Q8_0)
    q8 = gguf_kernel.BlockPlanes(q8.qs, q8.d, None, int8_activations=True)
    assert not q8._args[0] & gguf_kernel.INT8_ACTIVATIONS


# ---------------------------------------------------------------- models


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """A tiny llama as Q4_1 and as Q8_0 GGUF files, and its HF folder."""
    tmp = tmp_path_factory.mktemp("quant")
    folder = make_tiny_hf_model("llama", tmp, std=0.3)
    paths = {qt: write_tiny_gguf(folder, str(tmp / f"{qt}.gguf"), qt) for qt in ("Q4_1", "Q8_0")}
    return folder, paths


def _decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of each position, one token per step (batch-1 decode: the int kernels)."""
    from model_utils import PagedRunner

    runner = PagedRunner(model)
    runner.add(0, ids)
    return torch.cat([runner.step([(0, 1)])[0] for _ in ids])


@needs_block_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_model_computes_the_dequantized_weights(tiny_ggufs, qtype):
    """The block kernel reads the file's values: batch-1 decode logits are the dequantized
    model's up to float32 summation order."""
    path = tiny_ggufs[1][qtype]
    ref = load_our_model(path, quantization="none")
    model = load_our_model(path, quantization="gguf")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ == "GGUFBlocksMethod" and qkv.weight is None
    assert isinstance(qkv.packed_weight, GGUFBlockWeight)
    assert isinstance(model.lm_head.packed_weight, GGUFBlockWeight)
    ids = [5, 77, 301, 12, 9, 400]
    want, got = _decode_logits(ref, ids), _decode_logits(model, ids)
    _close(got, want, 1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position from one prefill step (more rows than the blocks take)."""
    from model_utils import PagedRunner

    runner = PagedRunner(model)
    runner.add(0, ids)
    return runner.step([(0, len(ids))])[0]


@needs_block_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_without_dense_copies_large_batches_dequantize_the_blocks(tiny_ggufs, qtype, monkeypatch):
    """PAGELLM_CPU_QUANT_DENSE_COPY=0: no layer keeps a dequantized copy, and a prefill of more
    rows than the blocks take dequantizes each layer's blocks per call: its logits are the
    model with copies' (the same weights, bit for bit) and the dequantized model's."""
    path = tiny_ggufs[1][qtype]
    ids = [5, 77, 301, 12, 9, 400, 33, 2, 150, 61, 7, 288] * 3  # 36 rows > MAX_ROWS_NO_COPY
    ref = load_our_model(path, quantization="none")
    with_copies = load_our_model(path, quantization="gguf")
    monkeypatch.setenv("PAGELLM_CPU_QUANT_DENSE_COPY", "0")
    lean = load_our_model(path, quantization="gguf")
    qkv = lean.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed_weight, GGUFBlockWeight) and qkv.packed_weight.dense is None
    assert with_copies.model.layers[0].self_attn.qkv_proj.packed_weight.dense is not None
    want = _prefill_logits(ref, ids)
    got = _prefill_logits(lean, ids)
    _close(got, want, 1e-4)
    torch.testing.assert_close(got, _prefill_logits(with_copies, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    _close(_decode_logits(lean, ids[:4]), _decode_logits(ref, ids[:4]), 1e-4)  # the blocks


@needs_block_kernel
def test_engine_without_dense_copies_gives_the_same_greedy_ids(
    tiny_ggufs, tiny_chat_model, monkeypatch
):
    """An engine whose GGUF layers keep no copy (its C++ decoder loop hands steps beyond the
    blocks' rows to the layers, which dequantize per call) gives the greedy ids of the engine
    with copies: prefills of 25-50 rows, decode steps of 6 rows, then 1."""
    from pagellm import LLM, SamplingParams

    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    path = tiny_ggufs[1]["Q4_1"]
    requests = [{"prompt_token_ids": [3 + i, 17, 99, 250, 7] * (5 + i)} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = {}
    for copy in ("1", "0"):
        monkeypatch.setenv("PAGELLM_CPU_QUANT_DENSE_COPY", copy)
        engine = dict(tokenizer=tiny_chat_model, max_model_len=128, max_num_seqs=8)
        with LLM(model=path, dtype="float32", **engine) as llm:
            ids[copy] = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    assert ids["0"] == ids["1"]


def test_dense_copies_are_kept_while_they_fit(monkeypatch, caplog):
    """auto keeps the copies when together they take at most a quarter of the machine's
    memory; 1 and 0 force it; the decision is taken once, at the first question."""
    page, pages = 4096, 1 << 20  # a 4 GiB machine
    import os

    real_sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {
        "SC_PAGE_SIZE": page, "SC_PHYS_PAGES": pages}.get(name) or real_sysconf(name))  # fmt: skip
    small, large = cpu_int.DenseCopies(), cpu_int.DenseCopies()
    small.count(1024, 1024 * 256, torch.float32)  # 1 GiB: a quarter
    large.count(1024, 1024 * 256 + 32, torch.float32)
    with caplog.at_level("INFO", logger="pagellm.quantization.cpu_int"):
        assert small.keep() and not large.keep()
    assert "no dequantized copies" in caplog.text and "PAGELLM_CPU_QUANT_DENSE_COPY" in caplog.text
    large.count(1, 1, torch.float32)
    assert not large.keep()  # decided once
    for value, keep in (("1", True), ("0", False)):
        monkeypatch.setenv("PAGELLM_CPU_QUANT_DENSE_COPY", value)
        copies = cpu_int.DenseCopies()
        copies.count(1024, 1024 * 1024, torch.float32)
        assert copies.keep() is keep
    monkeypatch.setenv("PAGELLM_CPU_QUANT_DENSE_COPY", "maybe")
    with pytest.raises(ValueError, match="PAGELLM_CPU_QUANT_DENSE_COPY='maybe'"):
        cpu_int.DenseCopies().keep()


@needs_block_kernel
def test_dequantize_into_scratch_is_the_dequantized_weight():
    """The C++ dequantization of each plane kind, float32 and bfloat16, equals torch's decode
    of the same blocks; the buffer is reused by a smaller layer."""
    gen = torch.Generator().manual_seed(7)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        n, k = 48, 96
        raw = torch.randint(0, 256, (n, k // 32 * gguf.GGML_QUANT_SIZES[qtype][1]),
                            dtype=torch.uint8, generator=gen)  # fmt: skip
        blocks = raw.view(n, k // 32, -1)
        blocks[..., :2] = torch.tensor([0x66, 0x2E], dtype=torch.uint8)  # d = 0.1
        if qtype == Q.Q4_1:
            blocks[..., 2:4] = torch.tensor([0x66, 0xAE], dtype=torch.uint8)  # m = -0.1
        want = decode_blocks(raw.reshape(n * k // 32, -1), qtype).view(n, k)
        planes = gguf_kernel.BlockPlanes.from_blocks(raw.contiguous(), qtype)
        for dtype in (torch.float32, torch.bfloat16):
            got = gguf_kernel.dequantize_into_scratch(planes, dtype)
            assert got.shape == (n, k) and torch.equal(got, want.to(dtype)), (qtype, dtype)
    small = gguf_kernel.BlockPlanes.from_blocks(raw[:4].contiguous(), Q.Q8_0)
    out = gguf_kernel.dequantize_into_scratch(small, torch.float32)
    assert torch.equal(out, want[:4])
    # float16 (a CPU model may run in it): the float32 weight converted; and a layer without
    # a copy takes float16 rows through it (the blocks read float32 and bf16 rows only)
    half = gguf_kernel.dequantize_into_scratch(small, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, want[:4].half())
    x = torch.randn(3, k, generator=gen).half()
    torch.testing.assert_close(GGUFBlockWeight(small, None)(x), x @ want[:4].half().t())


@needs_int8_dots
def test_int8_activations_switch_reaches_the_model(tiny_ggufs, monkeypatch):
    """With PAGELLM_CPU_INT8_ACTIVATIONS=1 a GGUF model's 4-bit layers round x: decode logits
    off the exact ones by about what bf16 activations are (this random model is chaotic)."""
    path = tiny_ggufs[1]["Q4_1"]
    exact = load_our_model(path, quantization="gguf")
    monkeypatch.setenv("PAGELLM_CPU_INT8_ACTIVATIONS", "1")
    model = load_our_model(path, quantization="gguf")
    planes = model.model.layers[0].self_attn.qkv_proj.packed_weight.planes
    assert planes._args[0] & gguf_kernel.INT8_ACTIVATIONS
    ids = [5, 77, 301, 12, 9, 400]
    want, got = _decode_logits(exact, ids), _decode_logits(model, ids)
    bf16 = _decode_logits(load_our_model(path, torch.bfloat16, quantization="gguf"), ids)
    distance = ((got - want).norm() / want.norm()).item()  # 0.048 (bf16 activations: 0.051)
    assert 1e-5 < distance < 1.5 * ((bf16.float() - want).norm() / want.norm()).item()


@needs_int_kernels
@pytest.mark.parametrize(("qtype", "quantization", "kind"), [
    ("Q4_1", "gguf", "GGUFBlocksMethod"),
    ("Q8_0", "gguf", "FloatToIntMethod"),
    ("Q4_1", "int8", "FloatToIntMethod"),
])  # fmt: skip
def test_int_kernel_model_logits_close_to_dequantized(
    tiny_ggufs, qtype, quantization, kind, monkeypatch
):
    """torch's int4 / int8 kernels (`int8`, and `gguf` where the block kernel is not):
    bfloat16 activations, Q8_0 requantized."""
    monkeypatch.setattr(gguf_kernel, "supported", lambda: False)
    path = tiny_ggufs[1][qtype]
    ref = load_our_model(path, quantization="none")
    model = load_our_model(path, quantization=quantization)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ == kind
    assert isinstance(qkv.packed_weight, CpuQuantizedWeight) and qkv.weight is None
    assert isinstance(model.lm_head.packed_weight, CpuQuantizedWeight)
    ids = [5, 77, 301, 12, 9, 400]
    want, got = _decode_logits(ref, ids), _decode_logits(model, ids)
    tol = 0.05 if quantization == "gguf" and qtype == "Q4_1" else 0.1  # int8 is requantized
    _close(got, want, tol)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@needs_int_kernels
def test_tied_head_is_quantized(tmp_path):
    """`int4` on an HF checkpoint: the tied LM head is the embedding quantized to int4."""
    folder = make_tiny_hf_model("llama", tmp_path, std=0.3, tie_word_embeddings=True)
    model = load_our_model(folder, quantization="int4")
    head = model.packed_tied_head
    assert isinstance(head, CpuQuantizedWeight)
    model.prepack_cpu_weights(batch_hint=8)  # keeps it
    assert model.packed_tied_head is head
    deq = dequantize_int4(*quantize_int4(model.model.embed_tokens.weight, 32))
    x = torch.randn(2, deq.shape[1])
    _close(model.compute_logits(x), x @ deq.t(), 2e-2)


@needs_int_kernels
def test_moe_routers_stay_unquantized(tmp_path):
    """As in vLLM: a router's scores pick the experts, so quantization leaves it alone (and
    fp8 checkpoints store it unquantized)."""
    folder = make_tiny_hf_model("qwen2_moe", tmp_path, std=0.3)
    model = load_our_model(folder, quantization="int8")
    mlp = model.model.layers[0].mlp
    assert mlp.gate.quant_method is None and mlp.shared_expert_gate.quant_method is None
    assert mlp.shared_expert.down_proj.quant_method is not None


# ---------------------------------------------------------------- selection


def test_default_for_gguf_files(monkeypatch):
    """GGUF files on the CPU stay quantized by default where the block kernel runs (64 of
    64 of the embedded model's 32-token greedy continuations are the dequantized path's,
    docs/benchmarks.md); elsewhere, and for other checkpoints, nothing is quantized."""
    monkeypatch.setattr(gguf_kernel, "supported", lambda: True)
    assert resolve_quantization(None, None, "gguf", CPU) == "gguf"
    assert resolve_quantization(None, None, "hf", CPU) is None
    assert resolve_quantization("none", None, "gguf", CPU) is None
    assert resolve_quantization(None, None, "gguf", torch.device("cuda")) is None
    assert resolve_quantization(None, None, "gguf", CPU, tensor_parallel_size=2) is None
    monkeypatch.setattr(gguf_kernel, "supported", lambda: False)
    assert resolve_quantization(None, None, "gguf", CPU) is None


def test_int_methods_only_where_the_cpu_runs_their_kernels(monkeypatch):
    monkeypatch.setattr(gguf_kernel, "supported", lambda: False)
    monkeypatch.setattr(cpu_int, "cpu_int_supported", lambda: True)
    assert resolve_quantization("gguf", None, "gguf", CPU) == "gguf"
    assert resolve_quantization("int4", None, "hf", CPU) == "int4"
    monkeypatch.setattr(cpu_int, "cpu_int_supported", lambda: False)
    for name in ("gguf", "int4", "int8"):
        with pytest.raises(ValueError, match=f"quantization='{name}' needs an x86 CPU"):
            resolve_quantization(name, None, "gguf", CPU)
    assert resolve_quantization("none", None, "gguf", CPU) is None
    monkeypatch.setattr(gguf_kernel, "supported", lambda: True)  # gguf needs only the blocks'
    assert resolve_quantization("gguf", None, "gguf", CPU) == "gguf"
    with pytest.raises(ValueError, match="quantization='int4' needs an x86 CPU"):
        resolve_quantization("int4", None, "hf", CPU)


def test_cpu_int_supported_probes_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_int.platform, "machine", lambda: "aarch64")
    assert not cpu_int.cpu_int_supported()
    monkeypatch.setattr(cpu_int.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not cpu_int.cpu_int_supported()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_int.cpu_int_supported()


@pytest.mark.parametrize(("name", "kind", "device", "message"), [
    ("int3", "hf", "cpu", "quantization must be None or one of"),
    ("GGUF", "gguf", "cpu", "quantization must be None or one of"),
    ("gguf", "hf", "cpu", "needs a GGUF file"),
    ("int4", "hf", "cuda", "runs on the CPU only"),
    ("fp8", "hf", "cpu", "on the CPU use 'int8' or 'int4'"),
    ("compressed-tensors", "hf", "cuda", "needs a compressed-tensors checkpoint"),
])  # fmt: skip
def test_bad_quantization_values(name, kind, device, message, monkeypatch):
    monkeypatch.setattr(cpu_int, "cpu_int_supported", lambda: True)  # the other checks
    with pytest.raises(ValueError, match=message):
        resolve_quantization(name, None, kind, torch.device(device))


def test_quantization_runs_on_one_rank():
    with pytest.raises(ValueError, match="quantization='fp8' runs on one rank"):
        resolve_quantization("fp8", None, "hf", torch.device("cuda"), tensor_parallel_size=2)
    assert resolve_quantization(None, None, "hf", CPU, tensor_parallel_size=2) is None


def test_engine_args_reject_bad_quantization(tiny_ggufs, monkeypatch):
    monkeypatch.setattr(cpu_int, "cpu_int_supported", lambda: True)
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=tiny_ggufs[0], quantization="awq", device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        EngineArgs(model=tiny_ggufs[0], quantization="gguf", device="cpu").create_engine_config()


def test_cli_flag_reaches_engine_args():
    import argparse

    from pagellm.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).quantization is None
    args = engine_args_from(parser.parse_args(["--quantization", "fp8"]))
    assert args.quantization == "fp8"
    with pytest.raises(ValueError, match="quantization='fp8' quantizes weights for CUDA"):
        args.create_engine_config()  # the embedded GGUF on the CPU


def test_no_block_kernel_without_a_compiler(broken_compiler):
    """No C++ compiler (or a failing one): no block kernel, so GGUF files stay dequantized
    by default rather than taking the bf16-activation int kernels."""
    gguf_kernel.kernel.cache_clear()
    try:
        assert gguf_kernel.kernel() is None and not gguf_kernel.supported()
        assert resolve_quantization(None, None, "gguf", CPU) is None
    finally:
        gguf_kernel.kernel.cache_clear()  # the next user builds (or finds) the real kernel


@needs_block_kernel
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-fma -mno-f16c"],
                         ids=["avx2", "scalar"])  # fmt: skip
def test_kernels_without_avx512_compute_the_same(flags, tmp_path, monkeypatch):
    """The block GEMM and the dequantization built as for a CPU without AVX-512 (laptops:
    8-float vectors) or without vectors at all give the native build's results: the
    dequantized weights bit for bit, the GEMM's up to float32 summation order."""
    import ctypes
    import shutil
    import stat

    from pagellm import cpp_build

    # the native kernels first: a loader whose cache was cleared (test_no_block_kernel_...)
    # would otherwise build under the wrapper below and keep that build for the session
    native = (gguf_kernel.kernel(), gguf_kernel.dequant_kernel(), gguf_kernel.greedy_kernel())
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++") or "c++"} "$@" {flags}\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    lib = ctypes.CDLL(str(cpp_build.build("gguf_gemm")))
    gemm, dequant = lib.pagellm_gguf_gemm, lib.pagellm_gguf_dequant
    gemm.argtypes, dequant.argtypes = native[0].argtypes, native[1].argtypes
    gen = torch.Generator().manual_seed(11)
    n, k = 40, 128
    planes = gguf_kernel.BlockPlanes(
        torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
        (torch.rand(n, k // 32, generator=gen) * 0.02).half(),
        (torch.rand(n, k // 32, generator=gen) * -0.1).float(),
    )
    kind, qs, d, m, _ = planes._args
    for dtype, x_kind in ((torch.float32, 0), (torch.bfloat16, 1)):
        out = torch.empty(n, k, dtype=dtype)
        assert dequant(kind, qs, d, m, n, k, out.data_ptr(), x_kind) == 0
        assert torch.equal(out, gguf_kernel.dequantize_into_scratch(planes, dtype)), dtype
        x = torch.randn(5, k, generator=gen).to(dtype)
        y = torch.empty(5, n, dtype=dtype)
        assert gemm(x.data_ptr(), 5, k, x_kind, kind, qs, d, m, n, y.data_ptr(), None) == 0
        want = gguf_kernel.block_gemm(x, planes)
        torch.testing.assert_close(y.float(), want.float(), rtol=1e-2 if x_kind else 1e-5,
                                   atol=1e-2 if x_kind else 1e-5)  # fmt: skip
