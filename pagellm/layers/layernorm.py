"""`RMSNorm` (+ residual add): float32 arithmetic cast back, as HF's; one fused kernel on
CUDA and on the CPU (`fused_ops.py`), its fp8 output for a w8a8 GEMM after it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers import fused_ops
from pagellm.quantization.base import QuantizedActivation


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back (as HF does).

    `quant_for`: the weight of the GEMM the output feeds; where it takes fp8 input (w8a8
    `quantization="fp8"` at batch > 16) the norm's kernel writes it quantized
    (`QuantizedActivation`), bit for bit what that GEMM's own quantization would produce."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, quant_for: Any = None) -> torch.Tensor | QuantizedActivation:
        # x: [..., size]
        quantized = self._quantized(x, None, quant_for)
        if quantized is not None:
            return quantized[0]
        fused = self._fused(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)[0]
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, quant_for: Any = None
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """Add the residual stream first (None: x is the stream, as before a model's first
        layer); return (normed, new residual)."""
        if residual is None:
            return self.forward(x, quant_for), x
        quantized = self._quantized(x, residual, quant_for)
        if quantized is not None:
            return quantized
        fused = self._fused(x)
        if fused is not None and x.dim() == 2:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        residual = x + residual
        return self.forward(residual), residual

    def _quantized(self, x, residual, quant_for) -> tuple[QuantizedActivation, Any] | None:
        """(the output quantized for `quant_for`, x + residual) from one Triton kernel where
        that weight takes fp8 input; None otherwise."""
        group = fused_ops.fp8_input_group(x, x.shape[-1], quant_for)
        if group is None or self.weight.dtype != x.dtype:
            return None
        q, scale, res = fused_ops.triton_ops().rms_norm_fp8(
            x, self.weight, self.eps, residual, group
        )
        return QuantizedActivation(q, scale, x.dtype), res

    def _fused(self, x: torch.Tensor):
        fused = fused_ops.ops_for(x)
        ok = fused is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1
        return fused if ok and x.dim() in (2, 3) else None
