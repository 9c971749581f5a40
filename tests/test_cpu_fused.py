"""The C++ fused ops of the CPU decoder layer (`pagellm/kernels/cpu_fused.py`) against the torch
ops they replace: bf16 results bit for bit (rounded as torch rounds, op by op), float32 within
a few ulp (RMSNorm's sum order, exp's last bits), and the layers' choice of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_fused
from pagellm.layers import fused_ops
from pagellm.layers.layernorm import RMSNorm
from pagellm.models.gemma2 import GemmaRMSNorm

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C++ compiler here")
DTYPES = [torch.float32, torch.bfloat16]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (48, 576), (5, 100), (3, 17), (130, 64)])
def test_rms_norm_with_and_without_residual(dtype, rows, n):
    torch.manual_seed(rows * n)
    x, res = _randn(rows, n, dtype=dtype, scale=3), _randn(rows, n, dtype=dtype)
    w = _randn(n, dtype=dtype)
    ref = lambda t: w * F.rms_norm(t.float(), (n,), eps=1e-5).to(dtype)  # noqa: E731
    out, res_out = cpu_fused.rms_norm(x, w, 1e-5, res)
    assert torch.equal(res_out, x + res)  # the residual stream exactly
    _same(out, ref(x + res))
    out, none = cpu_fused.rms_norm(x, w, 1e-5)
    assert none is None
    _same(out, ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_strided_view(dtype):
    """Qwen3's q/k norm: [T, heads, D] rows of a view into the qkv projection."""
    torch.manual_seed(0)
    qkv = _randn(7, 12, 64, dtype=dtype)
    q = qkv[:, :8]  # token stride 12 * 64, head stride 64
    w = _randn(64, dtype=dtype)
    out, _ = cpu_fused.rms_norm(q, w, 1e-6)
    _same(out, w * F.rms_norm(q.float(), (64,), eps=1e-6).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,d", [(48, 12, 64), (3, 5, 128), (2, 3, 10), (1, 1, 256)])
def test_rotary_of_strided_heads(dtype, tokens, heads, d):
    torch.manual_seed(d)
    qkv = _randn(tokens, heads + 4, d, dtype=dtype)
    x = qkv[:, :heads]
    cos_sin = _randn(tokens, 1, d, dtype=dtype)
    cos, sin = cos_sin.chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    got = cpu_fused.rotary(x, cos_sin)
    assert got.is_contiguous()
    if dtype == torch.float32:  # no fused multiply-adds: torch's roundings exactly
        assert torch.equal(got, want)
    _same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (48, 1536), (4, 33), (2, 7)])
def test_silu_and_mul(dtype, rows, n):
    torch.manual_seed(n)
    x = _randn(rows, 2 * n, dtype=dtype, scale=4)
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp's under- and overflow
    gate, up = x.chunk(2, dim=-1)
    _same(cpu_fused.silu_and_mul(x), F.silu(gate) * up)


def test_bad_operands_are_refused():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused.rms_norm(x, torch.randn(32), 1e-6)
    with pytest.raises(ValueError, match="match"):
        cpu_fused.rms_norm(x, torch.randn(64).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_fused.rms_norm(x, torch.randn(64), 1e-6, torch.randn(4, 32))
    with pytest.raises(ValueError, match="cos_sin"):
        cpu_fused.rotary(torch.randn(4, 2, 64), torch.randn(4, 1, 32))
    with pytest.raises(ValueError, match="silu_and_mul"):
        cpu_fused.silu_and_mul(torch.randn(4, 63))


def test_layers_take_them_on_the_cpu():
    """RMSNorm, rotary and SiLU-and-mul of a layer go through the C++ ops for float32 / bf16
    CPU tensors (same results as the torch path), not for other dtypes; Gemma's norm, whose
    weight is float32 whatever the activations, keeps its torch ops."""
    x = torch.randn(6, 64)
    assert fused_ops.ops_for(x) is cpu_fused and fused_ops.ops_for(x.bfloat16()) is cpu_fused
    assert fused_ops.ops_for(x.half()) is None and fused_ops.ops_for(x.double()) is None
    assert GemmaRMSNorm(64, 1e-6)._fused(x) is None
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64).bfloat16()
    h, r = torch.randn(6, 64).bfloat16(), torch.randn(6, 64).bfloat16()
    normed, residual = norm.forward_with_residual(h, r)
    assert torch.equal(residual, h + r)
    assert torch.equal(
        normed, norm.weight * F.rms_norm((h + r).float(), (64,), eps=1e-5).bfloat16()
    )
