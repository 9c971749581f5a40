"""fp8 MoE experts on CUDA (`quantization="fp8"`): an fp8 checkpoint's expert projections kept
as stored, or a bf16 model's experts quantized at load (a scale per row), stacked by expert:

    w13        float8_e4m3fn [E, 2I, H]   gate rows, then up rows (w2: [E, H, I])
    w13_scale  float32 [E, 2I] (per-tensor and per-channel checkpoints, a row's), or
               [E, 2I / 128, H / 128] (128 x 128 blocks: `weight_scale_inv`, or
               compressed-tensors' block `weight_scale`)

and run by the fused MoE kernel with fp8 weights (`pagellm/kernels/fused_moe_quant.py`,
dequantized in registers). Block scales need I and H multiples of 128 (every fp8 block
checkpoint's); otherwise, on the CPU and with quantization="none" the experts are dequantized
at load (`pagellm/layers/moe_weights.py`). fp8 runs on one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.quantization.base import ExpertsMethod, QuantizedExperts, drop_params, replace_param

FP8 = torch.float8_e4m3fn
BLOCK = 128
STACKS = ("w13", "w2")


class Fp8GpuExperts(QuantizedExperts):
    """fp8 experts on CUDA: the fused MoE kernels with fp8 weights."""

    def __init__(self, w13, w2) -> None:
        from pagellm.kernels import fused_moe_quant

        self.kernels = fused_moe_quant
        self.w13, self.w2 = w13, w2  # QuantizedStack each

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extras):
        return self.kernels.fused_moe_quant(x, self.w13, self.w2, weights, ids, **extras)


class Fp8ExpertsMethod(ExpertsMethod):
    """One MoE layer's fp8 experts: as stored (`scheme` "tensor" | "channel" | "block") or
    quantized at load (`scheme` None: the float w13 / w2 are loaded, then quantized)."""

    def __init__(self, scheme: str | None, block_scale_name: str, quantize: Callable) -> None:
        self.scheme = scheme
        self.scale_names = {"weight_scale", block_scale_name}
        self.quantize = quantize  # fp8.py's quantize_weight_per_row: [N, K] -> (q, scale [N])

    def create_weights(self, layer) -> None:
        if self.scheme is None:
            return
        e = layer.num_experts
        for stacked in STACKS:
            n, k = getattr(layer, stacked).shape[1:]
            replace_param(layer, stacked, (e, n, k), FP8)
            scale = (e, n // BLOCK, k // BLOCK) if self.scheme == "block" else (e, n)
            replace_param(layer, f"{stacked}_scale", scale, torch.float32)

    def checkpoint_param(self, layer, stacked: str, leaf: str) -> str | None:
        if leaf == "weight":
            return stacked
        return f"{stacked}_scale" if self.scheme and leaf in self.scale_names else None

    def tensor_slice(self, layer, param_name: str, part):
        return part  # one rank: whole tensors

    def process_weights_after_loading(self, layer) -> None:
        from pagellm.kernels.fused_moe_quant import QuantizedStack

        stacks = []
        for stacked in STACKS:
            w = getattr(layer, stacked).detach()
            if self.scheme is None:
                q, scale = self.quantize(w.reshape(-1, w.shape[2]))
                q, scale = q.view(w.shape), scale.view(w.shape[:2])
            else:
                q, scale = w, getattr(layer, f"{stacked}_scale").detach()
            drop_params(layer, stacked, f"{stacked}_scale")
            group = BLOCK if self.scheme == "block" else 0
            stacks.append(
                QuantizedStack(q.contiguous(), scale.float().contiguous(), None, 0, group)
            )
        layer.quantized_experts = Fp8GpuExperts(*stacks)

    def weight_bytes(self, layer) -> int:
        e, two_i, h = layer.num_experts, 2 * layer.part.size, layer.hidden_size
        values = e * 3 * (two_i // 2) * h
        rows = e * (two_i + h)
        scales = values // (BLOCK * BLOCK) if self.scheme == "block" else rows
        return values + 4 * scales


def fp8_experts_method(
    layer, scheme: str | None, block_scale_name: str, quantize: Callable
) -> ExpertsMethod | None:
    """The method for a MoE layer's experts, or None where block scales do not tile them
    (I or H not a multiple of 128: dequantized at load)."""
    if scheme == "block" and (layer.part.size % BLOCK or layer.hidden_size % BLOCK):
        return None
    return Fp8ExpertsMethod(scheme, block_scale_name, quantize)
