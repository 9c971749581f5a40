"""`GatedMLP`: gate | up column-parallel, the gated activation, down row-parallel; a
quantized gate | up may fuse the SiLU into its GEMM."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.activation import GATED_ACTIVATIONS, SiluAndMul
from pagellm.layers.linear import FusedLinear, RowParallelLinear
from pagellm.quantization.base import QuantizedActivation, QuantizedWeight


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU, or
    gelu-tanh for Gemma's GeGLU. Each rank holds 1/tp of the intermediate columns (gate_up
    column-parallel, down row-parallel)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported: {sorted(GATED_ACTIVATIONS)}")
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = FusedLinear(hidden_size, shards, bias=bias)
        self.act_fn = GATED_ACTIVATIONS[act]()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        # x: [T, hidden] (or quantized for gate_up by the norm before) -> [T, hidden]
        weight = self.gate_up_proj.packed_weight
        lora = self.gate_up_proj.lora is not None or self.down_proj.lora is not None
        if isinstance(self.act_fn, SiluAndMul) and isinstance(weight, QuantizedWeight) and not lora:
            # a quantized gate | up may fuse the activation into its GEMM (fp8 at batch 1)
            h = weight.silu_and_mul(x, self.gate_up_proj.bias)
            if h is not None:
                return self.down_proj(h)
            # the activation's kernel may quantize for down_proj (fp8 w8a8)
            return self.down_proj(self.act_fn(self.gate_up_proj(x), self.down_proj.packed_weight))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
