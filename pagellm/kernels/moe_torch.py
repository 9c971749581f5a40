"""The CPU's MoE experts in torch, and the reference the fused MoE kernels are tested against
(`pagellm/kernels/fused_moe.py`, `fused_moe_quant.py`): `experts_torch`, used by
`pagellm.layers.moe.FusedMoE` on the CPU and by the CPU's int experts
(`pagellm.quantization.wna16_cpu.WNA16CpuExperts`), whose weights are one `QuantizedWeight`
an expert."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def experts_torch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | Sequence[Callable],  # [E, 2I, H], or a QuantizedWeight an expert
    w2: torch.Tensor | Sequence[Callable],  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] expert ids
    bias13: torch.Tensor | None = None,  # [E, 2I] (gpt-oss)
    bias2: torch.Tensor | None = None,  # [E, H]
    activation: Callable | None = None,  # gpt-oss's ClampedSwiGLU; None: SiLU(gate) * up
) -> torch.Tensor:  # [T, H]
    """sum over k of weights[t, k] * expert ids[t, k] applied to x[t]: the N = T * K rows
    sorted by expert, one matmul pair per expert over its rows (a loop over experts, not
    tokens). Rounds where `fused_moe` rounds: each expert's output, then times the weight.
    An expert's weight may be a `QuantizedWeight` (the CPU's int experts, `wna16_cpu`)."""
    t, k = ids.shape
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)  # [N]: rows grouped by expert, in row order
    counts = torch.bincount(flat, minlength=len(w13)).tolist()  # the CPU path may sync
    rows = x[order // k]  # [N, H]
    y = torch.empty_like(rows)  # [N, H]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            b13 = None if bias13 is None else bias13[expert]
            gate_up = _linear(rows[start : start + count], w13[expert], b13)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up if activation is None else activation(gate, up)
            b2 = None if bias2 is None else bias2[expert]
            y[start : start + count] = _linear(act, w2[expert], b2)
        start += count
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    out = torch.empty_like(y)
    out[order] = y  # back to row order: row r is token r // K, its k-th expert
    return out.view(t, k, -1).sum(dim=1)


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T + bias for a float weight or a `QuantizedWeight`."""
    return F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w(x, bias)
