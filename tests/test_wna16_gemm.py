"""The Triton W4A16 / W8A16 kernels (`pagellm/kernels/wna16_gemm.py`) against x @ w^T with
the weight dequantized in torch: under Triton's interpreter on the CPU at small shapes (the
GEMV's rows, the GEMM's tiles, groups of 32 / 64 / one over K, a short last group, bias);
`gpu` tests at Llama-3.1-8B shapes and an engine on a packed tiny model."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from wna16_pack import Packing, quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if HAS_TRITON and DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the K loops have runtime bounds
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
X_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagellm.kernels.wna16_gemm import _int4_pairs

    @triton.jit
    def _pairs_tile(w_ptr, z_ptr, s_ptr, o_ptr, BF16: tl.constexpr, PTX: tl.constexpr):
        """[4, 16] values of `_int4_pairs` from [4, 2] words, as float32."""
        rows, words = tl.arange(0, 4), tl.arange(0, 2)
        qw = tl.load(w_ptr + rows[:, None] * 2 + words[None, :])
        dtype = tl.bfloat16 if BF16 else tl.float16
        v = _int4_pairs(qw, tl.load(z_ptr + rows), tl.load(s_ptr + rows), dtype, PTX)
        tl.store(o_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :], v.to(tl.float32))


def _weight(n: int, k: int, bits: int, group: int, sym: bool):
    """(canonical qweight, scales, zeros, dequantized float32 [N, K]) on DEVICE."""
    from pagellm.quantization.wna16_formats import dequantize

    q, scale, zero, _ = quantize(torch.randn(n, k), Packing("gptq", bits, group, sym))
    qweight = q.to(torch.uint8) if bits == 8 else (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    size = k if group == -1 else group
    zeros = zero.to(torch.uint8)
    deq = dequantize(qweight, scale, zeros, bits, size)
    return [t.to(DEVICE) for t in (qweight, scale, zeros, deq)] + [size]


@pytest.mark.parametrize("rows", [1, 3, 20])  # GEMV, GEMV, GEMM
@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, -1, True), (8, 64, True),
                                            (4, 64, False)])  # fmt: skip
def test_wna16_gemm_matches_dequantized(rows, bits, group, sym):
    from pagellm.kernels.wna16_gemm import wna16_gemm

    torch.manual_seed(rows + bits)
    n, k = 48, 160 if group == 32 else 128  # 160: a short last group of 32 (5 groups)
    if group == 64:
        k = 160  # groups of 64: 64, 64, 32
    qweight, scales, zeros, deq, size = _weight(n, k, bits, group, sym)
    x = torch.randn(rows, k, device=DEVICE).to(X_DTYPE)
    bias = torch.randn(n, device=DEVICE).to(X_DTYPE)
    got = wna16_gemm(x, qweight, scales, zeros, bits, size, bias).float()
    want = F.linear(x.float(), deq, bias.float())
    tol = 2e-2 * want.abs().max() if X_DTYPE != torch.float32 else 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=tol)


@pytest.mark.parametrize("bits,group,k", [(4, 32, 160), (8, 16, 176), (4, 64, 256), (4, -1, 160)])
@pytest.mark.parametrize("block_n,block_k", [(8, 128), (4, 64)])
def test_gemv_steps_over_several_groups(bits, group, k, block_n, block_k):
    """GEMV tiles whose K step holds 2-8 whole groups (each group's scale and zero applied to
    its own columns; a short last group, a last step past K), against the dequantized
    product."""
    from pagellm.kernels.wna16_gemm import wna16_gemm

    torch.manual_seed(k + block_n)
    qweight, scales, zeros, deq, size = _weight(40, k, bits, group, False)
    x = torch.randn(2, k, device=DEVICE).to(X_DTYPE)
    config = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 2}
    got = wna16_gemm(x, qweight, scales, zeros, bits, size, config=config).float()
    want = F.linear(x.float(), deq)
    tol = 2e-2 * want.abs().max() if X_DTYPE != torch.float32 else 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=tol)


@pytest.mark.parametrize("bits,group,k", [(4, 32, 160), (8, 64, 128), (4, -1, 96)])
def test_many_rows_take_the_dequantized_weight(monkeypatch, bits, group, k):
    """From DEQUANT_MIN_ROWS rows on (a prefill) the weight is dequantized into the scratch
    buffer (a short last group, one group over K, 8-bit) and multiplied by torch."""
    from pagellm.kernels import wna16_gemm as kernels

    monkeypatch.setattr(kernels, "DEQUANT_MIN_ROWS", 16)
    monkeypatch.setattr(kernels, "_SCRATCH", {})
    torch.manual_seed(k)
    qweight, scales, zeros, deq, size = _weight(40, k, bits, group, False)
    x = torch.randn(24, k, device=DEVICE).to(X_DTYPE)
    bias = torch.randn(40, device=DEVICE).to(X_DTYPE)
    got = kernels.wna16_gemm(x, qweight, scales, zeros, bits, size, bias).float()
    (scratch,) = kernels._SCRATCH.values()
    torch.testing.assert_close(scratch[: 40 * k].view(40, k).float(), deq, rtol=1e-2, atol=1e-6)
    want = F.linear(x.float(), deq, bias.float())
    tol = 2e-2 * want.abs().max() if X_DTYPE != torch.float32 else 1e-3
    torch.testing.assert_close(got, want, rtol=1e-2, atol=tol)


# the interpreter's tl.dot misreads bf16 operands: bf16 products are checked on CUDA, and the
# pairs' bf16 bits without a product (test_int4_pairs_hold_each_value_in_column_order)
PAIR_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16-gpu"),
               pytest.param(torch.float16, marks=pytest.mark.gpu, id="fp16-gpu")]  # fmt: skip


@pytest.mark.parametrize("dtype", PAIR_DTYPES)
@pytest.mark.parametrize("group,k,block_k", [(64, 160, 64), (-1, 128, 64), (128, 256, 128)])
def test_int4_weights_built_as_16_bit_pairs(dtype, group, k, block_k):
    """4-bit weights under bf16 / fp16 x: the GEMM builds a word's values j and j + 4 as one
    16-bit pair (`_int4_pairs`) and puts its 8 values back in column order. One-hot rows of x
    read single columns, so each output is one weight as the kernel built it: (q - zero) times
    the scale rounded to x's dtype, rounded once (the interpreter's cast truncates: one ulp).
    A short last group (160 = 64 + 64 + 32, the last step past K) and one group over K."""
    from pagellm.kernels.wna16_gemm import wna16_gemm

    torch.manual_seed(k + group)
    qweight, scales, zeros, _, size = _weight(64, k, 4, group, False)
    q = torch.stack([qweight & 15, qweight >> 4], -1).flatten(1).int()
    g = torch.arange(k, device=q.device) // size
    s16 = scales.to(dtype).float()[:, g]
    want = ((q - zeros.int()[:, g]) * s16).to(dtype)  # [N, K]
    cols = torch.randperm(k)[:24]
    x = torch.zeros(24, k, device=DEVICE, dtype=dtype)
    x[torch.arange(24), cols] = 1
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}
    got = wna16_gemm(x, qweight, scales, zeros, 4, size, config=config)
    if DEVICE == "cuda":
        torch.testing.assert_close(got, want[:, cols].t(), rtol=0, atol=0)
    else:
        torch.testing.assert_close(got.float(), want[:, cols].t().float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, *PAIR_DTYPES])
def test_int4_pairs_hold_each_value_in_column_order(dtype):
    """`_int4_pairs` alone (the interpreter's float32 model of its PTX, or the PTX on CUDA):
    words of 8 known values -> each value minus its row's zero, times the row's scale
    rounded to `dtype`, at its column (8 w + j)."""
    q = torch.randint(0, 16, (4, 16))
    words = (q.view(4, 2, 8) << (4 * torch.arange(8))).sum(-1)  # value j in bits 4j ..
    words = torch.where(words >= 2**31, words - 2**32, words).int()
    zeros = torch.tensor([8, 0, 15, 3], dtype=torch.int32)
    scales = torch.tensor([1.0, 0.013, 3.1e-3, 0.5])
    want = ((q - zeros[:, None]) * scales.to(dtype).float()[:, None]).to(dtype).float()
    out = torch.zeros(4, 16, device=DEVICE)
    on = [t.to(DEVICE) for t in (words, zeros, scales)]
    _pairs_tile[(1,)](*on, out, BF16=dtype == torch.bfloat16, PTX=DEVICE == "cuda")
    # the interpreter's bf16 casts truncate (the scale's and the product's)
    exact = DEVICE == "cuda" or dtype == torch.float16
    torch.testing.assert_close(out.cpu(), want, rtol=0 if exact else 2**-6, atol=0)


def test_wna16_gemm_checks_its_inputs():
    from pagellm.kernels.wna16_gemm import wna16_gemm

    qweight, scales, zeros, _, size = _weight(32, 64, 4, 32, True)
    x = torch.randn(2, 64, device=DEVICE).to(X_DTYPE)
    with pytest.raises(ValueError, match=r"wna16_gemm: x \(2, 64\), qweight \(32, 16\)"):
        wna16_gemm(x, qweight[:, :16], scales, zeros, 4, size)
    with pytest.raises(ValueError, match="4-bit groups of 64"):  # 2 scales a row: groups of 32
        wna16_gemm(x, qweight, scales, zeros, 4, 64)
    from pagellm.kernels.wna16_gemm import block_k

    with pytest.raises(ValueError, match="group size 24 is not a multiple of 16"):
        block_k(24, 64)
    with pytest.raises(ValueError, match="a K step of 96 is not a power of two"):
        wna16_gemm(x[:1], qweight, scales, zeros, 4, size, config={"BLOCK_N": 8, "BLOCK_K": 96})


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64, 512])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_wna16_gemm_at_llama_shapes(rows, shape):
    from pagellm.kernels.wna16_gemm import wna16_gemm

    n, k = shape
    qweight, scales, zeros, deq, size = _weight(n, k, 4, 128, True)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), deq)
    got = wna16_gemm(x, qweight, scales, zeros, 4, size).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.gpu
def test_gptq_engine_on_cuda_agrees_with_dequantized(tmp_path):
    """A packed tiny model on CUDA (Triton int4 kernels) against quantization='none' (its
    weights dequantized to bf16 at load): greedy continuations mostly agree (bf16)."""
    from model_utils import make_tiny_hf_model
    from wna16_pack import quantize_folder

    from pagellm import LLM, SamplingParams

    folder = make_tiny_hf_model("llama", tmp_path, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    quantize_folder(folder, str(tmp_path / "reference"), Packing("gptq", 4, 64, False, True))
    prompts = [{"prompt_token_ids": [3, 17, 99, 250 + i]} for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for quantization in (None, "none"):
        with LLM(model=folder, quantization=quantization, max_model_len=256) as llm:
            runs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(a[:4] == b[:4] for a, b in zip(runs[None], runs["none"]))
    assert same >= 12, same


@pytest.mark.gpu
def test_gptq_dummy_llama_8b_runs():
    """Llama-3.1-8B's shapes in int4 without a checkpoint: random GPTQ weights in groups of
    128 (load_format="dummy"), the Triton kernels in every Linear, CUDA graphs."""
    from pagellm import LLM, SamplingParams

    with LLM(model="llama-3.1-8b", load_format="dummy", quantization="gptq",
             max_model_len=1024) as llm:  # fmt: skip
        assert llm.llm_engine.config.model_config.quantization == "gptq"
        outs = llm.generate(
            [{"prompt_token_ids": list(range(100, 164))}] * 3,
            SamplingParams(max_tokens=8, ignore_eos=True),
        )
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_act_order_weight_gathers_x_by_its_permutation():
    """`WNA16GpuWeight` of an act-order layer, its columns sorted by group at load (as
    `WNA16LinearMethod` does): x is taken in the same order, so the product is the
    checkpoint's weight's."""
    from pagellm.quantization.wna16_formats import (
        dequantize,
        pack_nibbles,
        permute_columns,
        sort_groups,
    )
    from pagellm.quantization.wna16_gpu import gpu_weight

    q, scale, zero, g_idx = quantize(torch.randn(32, 128), Packing("gptq", 4, 32, False, True))
    qweight, zeros = pack_nibbles(q), zero.to(torch.uint8)
    deq = dequantize(qweight, scale, zeros, 4, 32, g_idx)
    perm = sort_groups(g_idx, 32)
    assert perm is not None and not torch.equal(perm, torch.arange(128))
    on = [t.to(DEVICE) for t in (permute_columns(qweight, 4, perm), scale, zeros, perm)]
    weight = gpu_weight(*on[:3], 4, 32, on[3])
    x = torch.randn(2, 128).to(DEVICE, X_DTYPE)
    want = F.linear(x.float(), deq.to(DEVICE))
    tol = 2e-2 * want.abs().max() if X_DTYPE != torch.float32 else 1e-3
    torch.testing.assert_close(weight(x).float(), want, rtol=1e-2, atol=tol)
    assert gpu_weight(qweight, scale, zeros, 4, 24, None) is None  # groups the kernels refuse


@pytest.mark.skipif(DEVICE == "cuda", reason="--tiny is the interpreter's check")
def test_benchmark_tiny_runs_the_timed_path():
    """`benchmarks/wna16.py --tiny`: the GEMV and the GEMM at each projection's tiny shape,
    int4 groups of 128, against the dequantized product."""
    from benchmark_modules import load

    results = load("wna16").run_tiny([1, 8])
    assert [r["rows"] for r in results] == [1, 8] * 4
    assert max(r["rel_err"] for r in results) < 1e-5
