"""int4 / int8 checkpoint weights on the CPU, read by the GGUF block kernel
(`gguf_kernel.py`, `pagellm/csrc/gguf_gemm.cpp`) at decode sizes.

A group of g inputs (g a multiple of 32) is g / 32 of the kernel's blocks, each with the
group's scale and offset, re-laid once at load, exactly (no value changes):

    4-bit   w = (q - zero) * scale = d * q + m,  d = scale (fp16), m = -zero * scale (float32:
            fp16 would round it), q 0..15 in the blocks' nibble order (byte i of a block:
            weights i and i + 16)
    8-bit   symmetric only: w = d * (q - 128), q - 128 as int8 (Q8_0's layout)

That holds where the scales are fp16 values (GPTQ's and AWQ's are; a bf16 scale is too unless
it is outside fp16's range). Larger batches (prefill chunks) multiply the dequantized copy,
packed like an unquantized layer's (`dense_weight`), or where the model's copies would not fit
(`cpu_int.DenseCopies`) the blocks dequantized into one reused buffer per call; a layer the
blocks cannot hold (groups not a multiple of 32, asymmetric 8-bit, scales fp16 cannot hold, no
block kernel here) is dequantized at load (None from `cpu_weight`).
"""

from __future__ import annotations

import torch

from pagellm.kernels.moe_torch import experts_torch
from pagellm.quantization import gguf_kernel
from pagellm.quantization.base import QuantizedExperts, QuantizedWeight
from pagellm.quantization.cpu_int import dense_weight
from pagellm.quantization.gguf_cpu import GGUFBlockWeight
from pagellm.quantization.gguf_kernel import BLOCK, BlockPlanes
from pagellm.quantization.wna16_formats import dequantize, unpack_canonical, unpermuted


class WNA16BlockWeight(GGUFBlockWeight):
    """`GGUFBlockWeight` (blocks for a few rows of x, the dequantized copy for more), an
    act-order layer's x gathered by `perm` for the blocks (their columns sorted by group)."""

    def __init__(self, planes: BlockPlanes, dense, perm: torch.Tensor | None) -> None:
        super().__init__(planes, dense)  # dense: x in the checkpoint's column order
        self.perm = perm  # [K] int64: block column j is checkpoint column perm[j]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]; the blocks' columns (also dequantized, without a copy) are
        # sorted by group
        if self.perm is not None and (self.dense is None or self.blocks_take(x)):
            x = x.index_select(1, self.perm)
        return super().__call__(x, bias)


def block_planes(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int
) -> BlockPlanes | None:
    """The canonical tensors (groups of `group` inputs, contiguous) as the block kernel's
    planes, or None where they do not fit it exactly."""
    q = unpack_canonical(qweight, bits)  # [N, K] uint8
    n, k = q.shape
    if k % BLOCK or group % BLOCK:
        return None
    # a scale a group, read once for its blocks (the last group may be cut short)
    group_blocks, scale, zero = group // BLOCK, scales.float(), zeros.float()
    if scale.shape[1] != -(-k // group):
        return None
    d = scale.to(torch.float16)
    if not torch.equal(d.float(), scale):
        return None
    if bits == 8:
        if not bool((zero == 128).all()):
            return None
        q8 = (q.to(torch.int16) - 128).to(torch.int8).contiguous()
        return BlockPlanes(q8, d.contiguous(), None, group_blocks=group_blocks)
    blocks = q.view(n, k // BLOCK, 2, BLOCK // 2)  # weights i and i + 16 share byte i
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    m = (-zero * scale).contiguous()
    return BlockPlanes(qs, d.contiguous(), m, group_blocks=group_blocks)


def cpu_weight(
    qweight: torch.Tensor,  # [N, K * bits / 8] canonical, groups contiguous
    scales: torch.Tensor,  # [N, G] float32
    zeros: torch.Tensor,  # [N, G] uint8
    bits: int,
    group: int,  # inputs a group
    perm: torch.Tensor | None,  # act-order: the checkpoint column of each kernel column
    dtype: torch.dtype,
    copy: bool = True,  # keep the dense copy (`cpu_int.DenseCopies`)
) -> QuantizedWeight | None:
    """The block kernel's weight with its dense copy (or without: large batches dequantize
    the blocks per call), or None (dequantize the layer)."""
    if not gguf_kernel.supported():
        return None
    planes = block_planes(qweight, scales, zeros, bits, group)
    if planes is None:
        return None
    if not copy:
        return WNA16BlockWeight(planes, None, perm)
    dense = unpermuted(dequantize(qweight, scales, zeros, bits, group), perm)
    return WNA16BlockWeight(planes, dense_weight(dense.to(dtype)), perm)


class WNA16CpuExperts(QuantizedExperts):
    """A MoE layer's int experts on the CPU: each expert projection's blocks, no dequantized
    copy (the experts are most of such a model). `experts_torch` runs them: an expert's few
    rows through the block kernel, more (prefill) through its blocks dequantized per call."""

    def __init__(self, w13: list[GGUFBlockWeight], w2: list[GGUFBlockWeight]) -> None:
        self.w13, self.w2 = w13, w2  # one weight an expert: [2I, H] and [H, I]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extras):
        return experts_torch(x, self.w13, self.w2, weights, ids, **extras)


def cpu_experts(
    stacks: dict[str, dict[str, torch.Tensor]],  # "w13" / "w2" -> canonical tensors by role
    bits: int,
    group_size: int,
) -> WNA16CpuExperts | None:
    """Stacked canonical experts ([E, N, K * bits / 8], scales and zeros [E, N, G]; no
    act-order) as the block kernel's planes, or None where it cannot hold them (then they are
    dequantized at load)."""
    if not gguf_kernel.supported():
        return None
    built = {}
    for stacked, t in stacks.items():
        q = t["qweight"]
        k = q.shape[2] * 8 // bits
        group = k if group_size == -1 else group_size
        experts = []
        for e in range(q.shape[0]):
            planes = block_planes(q[e], t["scales"][e], t["zeros"][e], bits, group)
            if planes is None:
                return None
            experts.append(GGUFBlockWeight(planes, None))
        built[stacked] = experts
    return WNA16CpuExperts(built["w13"], built["w2"])
