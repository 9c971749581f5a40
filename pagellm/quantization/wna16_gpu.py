"""int4 / int8 checkpoint weights on CUDA: `WNA16GpuWeight` runs the Triton GEMV (decode
rows) or tensor-core GEMM (`pagellm/kernels/wna16_gemm.py`) on the canonical layout, the
int weight read once a GEMM and dequantized in registers."""

from __future__ import annotations

import torch

from pagellm.quantization.base import QuantizedWeight


class WNA16GpuWeight(QuantizedWeight):
    """An int weight [N, K] in the canonical layout (groups contiguous), on CUDA."""

    def __init__(self, qweight, scales, zeros, bits: int, group: int, perm) -> None:
        from pagellm.kernels import wna16_gemm

        self.kernels = wna16_gemm
        self.qweight = qweight.contiguous()  # [N, K * bits / 8] uint8
        self.scales = scales.float().contiguous()  # [N, G]
        self.zeros = zeros.contiguous()  # [N, G] uint8
        self.bits, self.group = bits, group
        self.perm = perm  # [K] int64 (act-order: kernel column j is x's column perm[j])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K] bf16 / fp16 -> [T, N]
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return self.kernels.wna16_gemm(
            x.contiguous(), self.qweight, self.scales, self.zeros, self.bits, self.group, bias
        )


def gpu_weight(qweight, scales, zeros, bits: int, group: int, perm) -> QuantizedWeight | None:
    """The Triton kernels' weight, or None where they cannot take the layout (groups not a
    multiple of 16: the layer is dequantized)."""
    if group % 16:
        return None
    device = qweight.device
    perm = None if perm is None else perm.to(device=device, dtype=torch.int64)
    return WNA16GpuWeight(qweight, scales.to(device), zeros.to(device), bits, group, perm)


def gpu_experts(stacks: dict, bits: int, group_size: int):
    """A MoE layer's int experts for the fused MoE kernel (`WNA16GpuExperts`), or None where
    it cannot take them (groups not a multiple of 16: dequantized). `stacks`: "w13" / "w2" ->
    their canonical tensors by role."""
    from pagellm.kernels.fused_moe_quant import QuantizedStack
    from pagellm.quantization.wna16_moe import WNA16GpuExperts

    weights = []
    for tensors in (stacks["w13"], stacks["w2"]):
        k = tensors["qweight"].shape[2] * 8 // bits
        group = k if group_size == -1 else group_size
        if group % 16 or k % 16:
            return None
        weights.append(QuantizedStack(tensors["qweight"].contiguous(),
                                      tensors["scales"].float().contiguous(),
                                      tensors["zeros"].contiguous(), bits, group))  # fmt: skip
    return WNA16GpuExperts(*weights)
