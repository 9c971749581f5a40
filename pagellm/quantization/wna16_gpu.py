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
