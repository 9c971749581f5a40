"""The gated activations of an MLP: SiLU-and-mul (fused on CUDA and the CPU, its fp8 output
for a w8a8 down projection), GeGLU (exact gelu, or Gemma's gelu-tanh, and mul) and gpt-oss's
clamped SwiGLU (its experts')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers import fused_ops
from pagellm.quantization.base import QuantizedActivation


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, quant_for: Any = None) -> torch.Tensor | QuantizedActivation:
        # x: [T, 2 * I] (gate | up) -> [T, I]; quantized for `quant_for` as RMSNorm's output
        group = fused_ops.fp8_input_group(x, x.shape[-1] // 2, quant_for)
        if group is not None:
            return QuantizedActivation(*fused_ops.triton_ops().silu_and_mul_fp8(x, group), x.dtype)
        fused = fused_ops.ops_for(x)
        if fused is not None and x.dim() == 2 and x.stride(-1) == 1:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up with the exact (erf) gelu: HF's `hidden_act` "gelu"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate | up) -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up, gelu with its tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate | up) -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation, as HF computes it: gate clamped above at `limit`, up
    clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # gate, up: [N, I] -> [N, I]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# HF `hidden_act` / `hidden_activation` -> the gated activation of the MLP
GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": GeluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
    "gelu_new": GeluTanhAndMul,
}


def require_silu(config: Any, what: str) -> None:
    """Fused experts run SiLU-and-mul: a config whose `hidden_act` is another is refused
    (HF would run it in every expert)."""
    act = getattr(config, "hidden_act", None) or "silu"
    if GATED_ACTIVATIONS.get(act) is not SiluAndMul:
        raise ValueError(f"{what}: hidden_act {act!r} is not supported (its fused experts run "
                         "'silu')")  # fmt: skip
