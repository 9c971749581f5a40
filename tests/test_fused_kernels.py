"""Fused Triton ops (RMSNorm + residual, rotary, SiLU-and-mul) against the torch path of
`pagellm/layers/`. On a machine without CUDA they run under Triton's interpreter
(fp32 and fp16: the interpreter has no bf16); with CUDA, bf16 too. Outputs start as NaN
inside the kernels' wrappers (`torch.empty`), so an unwritten element fails the comparison.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the sampling kernel loops to a runtime bound

from pagellm.kernels import fused  # noqa: E402
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.rotary_embedding import apply_rotary, qk_norm_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _close(out, ref, dtype):
    torch.testing.assert_close(
        out.float().cpu(), ref.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype]
    )


def _torch_rms_norm(x, w, eps):
    normed = torch.nn.functional.rms_norm(x.float(), w.shape, eps=eps)
    return w * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576])
def test_rms_norm_with_residual(dtype, n):
    x, r = _randn(5, n, dtype=dtype), _randn(5, n, dtype=dtype, seed=1)
    w = _randn(n, dtype=dtype, seed=2)
    out, res = fused.rms_norm(x, w, 1e-6, r)
    _close(res, x + r, dtype)
    _close(out, _torch_rms_norm(x + r, w, 1e-6), dtype)
    out, none = fused.rms_norm(x, w, 1e-6)
    assert none is None
    _close(out, _torch_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    # q of a fused qkv output: [T, 3 heads, 32] inside [T, 3 + 2 + 2 heads, 32]
    qkv = _randn(4, 7, 32, dtype=dtype)
    q = qkv[:, :3]
    w = _randn(32, dtype=dtype, seed=3)
    out, _ = fused.rms_norm(q, w, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    _close(out, _torch_rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (5, 32)])
def test_rotary_matches_torch_on_a_strided_view(dtype, heads, head_dim):
    qkv = _randn(6, heads + 2, head_dim, dtype=dtype)
    x = qkv[:, :heads]
    angles = _randn(6, 1, head_dim // 2, dtype=torch.float32, seed=4)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)  # [T, 1, D]
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    _close(fused.rotary(x, cos_sin), ref, dtype)
    if DEVICE == "cuda":  # the layer dispatches to the kernel on CUDA
        _close(apply_rotary(x, cos_sin), ref, dtype)


def _torch_rotary(x, cos_sin):
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 32), (16, 8, 128)])
def test_qk_norm_rotary_matches_norm_then_rotary(dtype, heads, kv_heads, head_dim):
    """Qwen3's q/k RMSNorm + rotary in one kernel = the two ops of the torch path."""
    qkv = _randn(5, heads + 2 * kv_heads, head_dim, dtype=dtype)
    q_w, k_w = _randn(head_dim, dtype=dtype, seed=5), _randn(head_dim, dtype=dtype, seed=6)
    angles = _randn(5, 1, head_dim // 2, dtype=torch.float32, seed=4)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    q, k = fused.qk_norm_rotary(qkv, q_w, k_w, cos_sin, heads, kv_heads, 1e-6)
    assert q.shape == (5, heads, head_dim) and k.shape == (5, kv_heads, head_dim)
    ref_q = _torch_rotary(_torch_rms_norm(qkv[:, :heads], q_w, 1e-6), cos_sin)
    ref_k = _torch_rotary(_torch_rms_norm(qkv[:, heads : heads + kv_heads], k_w, 1e-6), cos_sin)
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    if DEVICE == "cuda":  # the layer dispatches to the kernel on CUDA
        norms = [RMSNorm(head_dim, 1e-6).to(DEVICE, dtype) for _ in range(2)]
        norms[0].weight.data.copy_(q_w)
        norms[1].weight.data.copy_(k_w)
        q2, k2 = qk_norm_rotary(qkv, *norms, cos_sin, heads, kv_heads)
        assert torch.equal(q2, q) and torch.equal(k2, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 3000])
def test_silu_and_mul(dtype, n):
    x = _randn(3, 2 * n, dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    _close(fused.silu_and_mul(x), ref, dtype)
    if DEVICE == "cuda":
        _close(SiluAndMul()(x), ref, dtype)


def _same_fp8(got: tuple, want: tuple) -> None:
    """(q, scale) pairs equal bit for bit (NaN-free: fp8 bytes compared as integers)."""
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


FP8_DTYPES = [torch.bfloat16, torch.float16]  # of fp8 models (bf16 runs interpreted too here)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize(("n", "group"), [(384, 0), (384, 128), (200, 0), (4096, 128)])
def test_rms_norm_fp8_is_the_norm_then_quantize_fp8(dtype, n, group):
    """The norm's fp8 output (the w8a8 GEMM's input) is `quantize_fp8` of its bf16 output,
    per row or per 128 columns, with and without the residual add; n not a power of two
    leaves masked columns in the kernel's block."""
    from pagellm.kernels.fp8_gemm import quantize_fp8

    x, r = _randn(5, n, dtype=dtype) * 4, _randn(5, n, dtype=dtype, seed=1)
    w = _randn(n, dtype=dtype, seed=2)
    for residual in (None, r):
        normed, res = fused.rms_norm(x, w, 1e-6, residual)
        q, scale, res_fp8 = fused.rms_norm_fp8(x, w, 1e-6, residual, group)
        _same_fp8((q, scale), quantize_fp8(normed, group or None))
        assert scale.shape == (5, n // group if group else 1)
        assert (res_fp8 is None) == (residual is None)
        if residual is not None:
            assert torch.equal(res_fp8, res)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize(("n", "group"), [(96, 0), (3000, 0), (17000, 0), (384, 128), (4352, 128)])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_fp8(dtype, n, group):
    """Per row in one pass (96, 3000: masked columns), or, past SILU_FP8_ROW columns (17000),
    in an amax pass and a store pass over 2048-column chunks (a ragged tail); per 128
    columns over several programs."""
    from pagellm.kernels.fp8_gemm import quantize_fp8

    x = _randn(3, 2 * n, dtype=dtype) * 3
    _same_fp8(fused.silu_and_mul_fp8(x, group), quantize_fp8(fused.silu_and_mul(x), group or None))


def test_fp8_output_wrappers_reject_bad_groups():
    x = _randn(2, 192, dtype=torch.float16)
    with pytest.raises(ValueError, match="group 128"):
        fused.rms_norm_fp8(x, _randn(192, dtype=torch.float16), 1e-6, None, 128)
    with pytest.raises(ValueError, match="group 128"):
        fused.silu_and_mul_fp8(_randn(2, 2 * 192, dtype=torch.float16), 128)


def test_wrappers_reject_bad_shapes():
    x = _randn(2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="rms_norm"):
        fused.rms_norm(x, _randn(4, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="rotary"):
        fused.rotary(_randn(2, 1, 6, dtype=torch.float32), _randn(2, 1, 6, dtype=torch.float32))
    with pytest.raises(ValueError, match="silu_and_mul"):
        fused.silu_and_mul(_randn(2, 7, dtype=torch.float32))
    w = _randn(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="qk_norm_rotary"):  # 5 heads is not 2 + 2 * 1
        fused.qk_norm_rotary(_randn(2, 5, 8, dtype=torch.float32), w, w, x[:, None], 2, 1, 1e-6)


def test_sample_greedy_rows_take_the_argmax_and_others_follow_the_distribution():
    from pagellm.kernels.sampling import sample

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    rows = 1500
    logits = probs.clamp_min(1e-30).log().repeat(rows, 1)  # [rows, 5]
    logits = torch.cat([logits, _randn(3, 5, dtype=torch.float32).cpu()]).to(DEVICE)
    temperature = torch.ones(rows + 3)
    temperature[rows:] = 0.0  # the last three rows are greedy
    out = sample(logits, temperature.to(DEVICE), torch.Generator().manual_seed(0)).cpu()
    assert torch.equal(out[rows:], logits[rows:].argmax(-1).cpu())
    freq = torch.bincount(out[:rows], minlength=5).float() / rows
    assert freq[4] == 0  # probability 0 is never drawn
    torch.testing.assert_close(freq, probs, atol=0.04, rtol=0)


def test_sample_spans_several_blocks_and_respects_temperature():
    from pagellm.kernels.sampling import sample

    logits = torch.full((64, 3000), -1e4)
    logits[:, 2500] = 0.0  # the only likely token sits in the third block of 1024
    logits[:, 7] = -1.0
    cold = sample(logits.to(DEVICE), torch.full((64,), 0.05, device=DEVICE)).cpu()
    assert (cold == 2500).all()  # at T=0.05, token 7 is e^-20 as likely
    hot = sample(logits.to(DEVICE), torch.full((64,), 5.0, device=DEVICE)).cpu()
    assert set(hot.tolist()) == {7, 2500}  # at T=5 both appear (p = 0.45 / 0.55)


def test_sample_picks_across_vocabulary_chunks():
    """Rows longer than one program's chunk: the best chunk wins, ties go to the lowest id."""
    from pagellm.kernels.sampling import CHUNK, sample

    vocab = 2 * CHUNK + 500
    logits = torch.full((8, vocab), -1e4)
    logits[:, CHUNK + 3] = 1.0  # a tie for the maximum in chunks 1 and 2: greedy takes the first
    logits[:, 2 * CHUNK + 7] = 1.0
    logits[4:, 2 * CHUNK + 7] = 30.0  # rows 4..7: one token dominates, in the last chunk
    temperature = torch.tensor([0.0] * 4 + [1.0] * 4)
    out = sample(logits.to(DEVICE), temperature.to(DEVICE)).cpu()
    assert out.tolist() == [CHUNK + 3] * 4 + [2 * CHUNK + 7] * 4


def test_sample_follows_the_distribution_across_chunks_and_blocks(monkeypatch):
    """Mass in two chunks and several blocks (T = 1 and T = 0.5), and a flat row whose
    draws must land in every part of the vocabulary: the chunk pick and the scan inside a
    chunk both count. Small blocks and chunks (constexprs) and few rows on the CPU keep it
    quick under the interpreter (~10 ms a program); the tolerance is 4.5 sigma."""
    from pagellm.kernels import sampling

    block, chunk = 16, 64
    monkeypatch.setattr(sampling, "BLOCK", block)
    monkeypatch.setattr(sampling, "CHUNK", chunk)
    vocab, rows = chunk + 10, 2000 if DEVICE == "cuda" else 200
    atol = 4.5 * (0.25 / rows) ** 0.5
    probs = torch.tensor([0.1, 0.2, 0.7])
    tokens = [5, 3 * block + 2, chunk + 7]  # chunk 0 (blocks 0 and 3), chunk 1
    logits = torch.full((2 * rows, vocab), float("-inf"))
    logits[:, tokens] = probs.log()
    temperature = torch.tensor([1.0] * rows + [0.5] * rows)
    gen = torch.Generator().manual_seed(1)
    out = sampling.sample(logits.to(DEVICE), temperature.to(DEVICE), gen).cpu()
    assert set(out.tolist()) <= set(tokens)
    which = torch.tensor([tokens.index(t) for t in out.tolist()])
    sharp = probs**2 / (probs**2).sum()  # T = 0.5
    for part, expected in ((which[:rows], probs), (which[rows:], sharp)):
        freq = torch.bincount(part, minlength=3).float() / rows
        torch.testing.assert_close(freq, expected, atol=atol, rtol=0)

    flat = torch.zeros((rows, vocab), device=DEVICE)  # every token equally likely
    out = sampling.sample(flat, torch.ones(rows, device=DEVICE), gen).cpu()
    edges = torch.tensor([2 * block, chunk, vocab])  # two blocks, the rest of chunk 0, chunk 1
    freq = torch.bincount(torch.bucketize(out, edges, right=True), minlength=3).float() / rows
    expected = torch.tensor([2 * block, chunk - 2 * block, vocab - chunk]) / vocab
    torch.testing.assert_close(freq[:3], expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # one rounding
def test_rms_norm_weight_first_is_gemmas_order(dtype):
    """Gemma's norm multiplies x / rms(x) by its float32 (1 + w) before the one rounding
    (HF's GemmaRMSNorm); Llama's rounds x / rms(x) first. Their outputs part in a good share
    of bf16 / fp16 elements, so each order's kernel must match its own reference."""
    x, r = _randn(64, 256, dtype=dtype), _randn(64, 256, dtype=dtype, seed=1)
    w = 1.0 + 3.0 * _randn(256, dtype=torch.float32, seed=2)
    gemma = (torch.nn.functional.rms_norm((x + r).float(), w.shape, eps=1e-6) * w).to(dtype)
    llama = _torch_rms_norm(x + r, w, 1e-6).to(dtype)
    out, res = fused.rms_norm(x, w, 1e-6, r, weight_first=True)
    assert torch.equal(res, x + r)
    assert (out == gemma).float().mean() > 0.99
    assert (out == llama).float().mean() < 0.95
