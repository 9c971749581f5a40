"""int4 / int8 MoE experts (AWQ, GPTQ, compressed-tensors pack-quantized checkpoints): each
expert projection's tensors in the canonical layout (`wna16_formats.py`), stacked by expert
like the float weights (`pagellm/layers/moe.py`):

    w13_qweight  uint8 [E, 2I, H * bits / 8]   gate rows, then up rows
    w13_scales   float32 [E, 2I, G(H)];  w13_zeros uint8 [E, 2I, G(H)]
    w2_qweight   uint8 [E, H, I * bits / 8];   w2_scales, w2_zeros [E, H, G(I)]
    w*_g_idx     int32 [E, parts, K]           act-order only: each part's groups

Tensor parallelism splits I as for float experts: w13's rows, w2's columns on group
boundaries (a split inside a group is a ValueError). After loading: on CUDA the Triton fused
MoE reads them as stored (`pagellm/kernels/fused_moe_quant.py`, `WNA16GpuExperts`); on the
CPU each expert's projections become the GGUF block kernel's planes, without a dequantized
copy (`wna16_cpu.WNA16CpuExperts`: the torch path over them); with act-order, without the
block kernel, or with quantization="none" they are dequantized to w13 / w2 in the model
dtype. The router is never quantized.
"""

from __future__ import annotations

from dataclasses import replace  # of a TensorSlice (pagellm/layers/weights.py, a floor above)

import torch
from torch import nn

from pagellm.quantization.base import ExpertsMethod, QuantizedExperts, drop_params, replace_param
from pagellm.quantization.wna16_formats import dequantize, random_canonical

STACKS = ("w13", "w2")


class WNA16GpuExperts(QuantizedExperts):
    """int experts on CUDA: the fused MoE kernels with int weights (dequantized in registers)."""

    def __init__(self, w13, w2) -> None:
        from pagellm.kernels import fused_moe_quant

        self.kernels = fused_moe_quant
        self.w13, self.w2 = w13, w2  # QuantizedStack each

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extras):
        return self.kernels.fused_moe_quant(x, self.w13, self.w2, weights, ids, **extras)


class WNA16ExpertsMethod(ExpertsMethod):
    """One MoE layer's int experts: stacked canonical tensors while loading, then the
    kernel's (CUDA) or dequantized w13 / w2."""

    def __init__(self, config) -> None:
        self.config = config  # WNA16Config
        self.scheme = config.scheme

    def _dims(self, layer, stacked: str, full: bool = False) -> tuple[int, int]:
        """(N, K) of one expert's projection(s) in `stacked`: this rank's, or with one rank."""
        i = layer.full_intermediate if full else layer.part.size
        return (2 * i, layer.hidden_size) if stacked == "w13" else (layer.hidden_size, i)

    def _groups(self, layer, stacked: str) -> int:
        s = self.scheme
        n, k = self._dims(layer, stacked)
        full_k = self._dims(layer, stacked, full=True)[1]
        if k == full_k or s.act_order or s.group_size == -1:
            return s.groups(full_k)
        if k % s.group_size:
            raise ValueError(
                f"tensor parallel: the experts' {full_k} intermediate columns split into {k} "
                f"per rank, not a multiple of the checkpoint's group_size {s.group_size}; use "
                "fewer ranks"
            )
        return k // s.group_size

    def create_weights(self, layer) -> None:
        s, e = self.scheme, layer.num_experts
        for stacked in STACKS:
            n, k = self._dims(layer, stacked)
            g = self._groups(layer, stacked)
            replace_param(layer, f"{stacked}_qweight", (e, n, k * s.bits // 8), torch.uint8)
            replace_param(layer, f"{stacked}_scales", (e, n, g), torch.float32)
            if s.has_zeros:
                replace_param(layer, f"{stacked}_zeros", (e, n, g), torch.uint8)
            if s.act_order:
                parts = 2 if stacked == "w13" else 1
                replace_param(layer, f"{stacked}_g_idx", (e, parts, k), torch.int32)
        drop_params(layer, *STACKS)

    def checkpoint_param(self, layer, stacked: str, leaf: str) -> str | None:
        role = {v: k for k, v in self.scheme.names.items()}.get(leaf)
        name = f"{stacked}_{role}"
        return name if role is not None and name in layer._parameters else None

    def tensor_slice(self, layer, param_name: str, part):
        """w13: this rank's rows (g_idx whole); w2: its columns' bytes, groups or g_idx."""
        stacked, _, role = param_name.partition("_")
        if stacked == "w13":
            return None if role == "g_idx" else part
        if role == "qweight":
            per = 8 // self.scheme.bits
            return replace(part, start=part.start // per, size=part.size // per)
        if role == "g_idx":
            return part
        full = self.scheme.groups(layer.full_intermediate)
        if getattr(layer, param_name).shape[2] == full:
            return None  # every group (act-order, one group, one rank)
        size = self.scheme.group_size
        return replace(part, start=part.start // size, size=part.size // size)

    def process_weights_after_loading(self, layer) -> None:
        stacks = {stacked: self._take(layer, stacked) for stacked in STACKS}
        weight = None if self.config.dequantize else self.config.experts_weight(stacks)
        if weight is not None:
            layer.quantized_experts = weight
            return
        for stacked, tensors in stacks.items():
            dense = self._dequantized(tensors, parts=2 if stacked == "w13" else 1)
            setattr(layer, stacked, nn.Parameter(dense.to(self.config.dtype), requires_grad=False))

    def _take(self, layer, stacked: str) -> dict[str, torch.Tensor]:
        """This stack's loaded tensors by role, dropped from the layer (zeros filled in)."""
        out = {}
        for role in ("qweight", "scales", "zeros", "g_idx"):
            param = layer._parameters.get(f"{stacked}_{role}")
            if param is not None:
                out[role] = param.detach()
                drop_params(layer, f"{stacked}_{role}")
        if "zeros" not in out:
            scales = out["scales"]
            out["zeros"] = torch.full(scales.shape, self.scheme.offset, dtype=torch.uint8,
                                      device=scales.device)  # fmt: skip
        return out

    def _dequantized(self, t: dict[str, torch.Tensor], parts: int) -> torch.Tensor:
        """float32 [E, N, K]: each expert's (and act-order: each part's) weight."""
        bits, experts = self.scheme.bits, []
        k = t["qweight"].shape[2] * 8 // bits
        group = self.scheme.group(k)
        for e in range(t["qweight"].shape[0]):
            rows = t["qweight"].shape[1] // parts
            experts.append(torch.cat([
                dequantize(t["qweight"][e, a : a + rows], t["scales"][e, a : a + rows],
                           t["zeros"][e, a : a + rows], bits, group,
                           t["g_idx"][e, j] if "g_idx" in t else None)
                for j, a in enumerate(range(0, rows * parts, rows))
            ]))  # fmt: skip
        return torch.stack(experts)

    def dummy_tensor(self, layer, param_name: str, std: float, generator) -> torch.Tensor | None:
        stacked, _, role = param_name.partition("_")
        if stacked not in STACKS or not role:
            return None
        n, k = self._dims(layer, stacked, full=True)
        e = layer.num_experts
        if role == "g_idx":
            row = random_canonical(self.scheme, role, n, k, std, generator)  # [1, K]
            return row.expand(e, 2 if stacked == "w13" else 1, k).contiguous()
        one = random_canonical(self.scheme, role, e * n, k, std, generator)
        return one.reshape(e, n, -1)

    def weight_bytes(self, layer) -> int:
        e, n13, h = layer.num_experts, *self._dims(layer, "w13")
        values = e * 3 * (n13 // 2) * h  # weights in the two stacks
        if self.config.dequantize or self.scheme.act_order:
            return values * self.config.dtype.itemsize
        if self.config.device.type == "cpu":  # the block kernel's planes (wna16_cpu)
            per_block = 2 + 4 * (self.scheme.bits == 4)  # fp16 scale, float32 offset
            return values * self.scheme.bits // 8 + values // 32 * per_block
        groups = sum(getattr(layer, f"{s}_scales").numel() for s in STACKS)
        return values * self.scheme.bits // 8 + groups * 5  # float32 scales, uint8 zeros
