"""gpt-oss's experts in the fused-MoE Triton kernels (HAS_BIAS: biased gate | up and down
GEMMs; CLAMPED: the clamped SwiGLU in the gate_up epilogue) against the torch path of
`pagellm/layers/moe.py` (`experts_torch` with the same biases and `ClampedSwiGLU`): under
Triton's interpreter on tiny shapes without CUDA, bf16 at gpt-oss-20b's shapes with it."""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import DEVICE, DTYPES, TINY, _close, _problem, _randn  # sets the interpreter

from pagellm.kernels import fused_moe as fm
from pagellm.layers.activation import ClampedSwiGLU
from pagellm.layers.moe import experts_torch


def _biases(e, h, i, dtype, seed=0):
    return _randn(e, 2 * i, dtype=dtype, seed=seed + 10), _randn(e, h, dtype=dtype, seed=seed + 11)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_fused_moe_bias_and_clamped_swiglu(dtype, num_tokens):
    """A limit of 0.5 clamps most gates and ups at these scales: both clamps and both
    biases matter (checked: without them the outputs differ)."""
    x, w13, w2, weights, ids = _problem(num_tokens, 4, 64, 32, dtype, seed=3)
    bias13, bias2 = _biases(4, 64, 32, dtype)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    out = fm.fused_moe(x, w13, w2, weights, ids, TINY, bias13, bias2, act)
    ref = experts_torch(x, w13, w2, weights, ids, bias13, bias2, act)
    _close(out, ref, dtype)
    plain = experts_torch(x, w13, w2, weights, ids, bias13, bias2, ClampedSwiGLU(1.702, 1e4))
    assert (plain - ref).abs().max() > 0.05
    assert (experts_torch(x, w13, w2, weights, ids, activation=act) - ref).abs().max() > 0.05


def test_fused_moe_rejects_a_bias_of_the_wrong_shape():
    x, w13, w2, weights, ids = _problem(3, 4, 64, 32, torch.float32)
    bias13, bias2 = _biases(4, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="fused_moe: bias"):
        fm.fused_moe(x, w13, w2, weights, ids, TINY, bias13[:, :10].contiguous(), bias2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_bf16_at_gpt_oss_20b_shapes(num_tokens):
    """32 experts, top-4, H = I = 2880, biases, the clamped SwiGLU (limit 7): against the
    torch path in float32."""
    x, w13, w2, weights, ids = _problem(num_tokens, 32, 2880, 2880, torch.bfloat16, top_k=4)
    bias13, bias2 = _biases(32, 2880, 2880, torch.bfloat16)
    act = ClampedSwiGLU()
    out = fm.fused_moe(x, w13, w2, weights, ids, None, bias13, bias2, act)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids, bias13.float(),
                        bias2.float(), act)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
