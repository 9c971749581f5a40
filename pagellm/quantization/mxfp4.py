"""MXFP4 expert weights (gpt-oss checkpoints, `quant_method: "mxfp4"`), dequantized at load.

A projection of E experts is stored as two tensors, its rows (outputs) first:

    <name>_blocks  [E, rows, G, 16] uint8: 32 FP4 (e2m1) values a group of columns, two a
                   byte, the even column in the low nibble
    <name>_scales  [E, rows, G] uint8: each group's power of two as E8M0 (2 ** (s - 127))

so the weight [E, rows, G * 32] is value * 2 ** (scale - 127). The model's loader
(`pagellm/models/gpt_oss.py`) pairs the two tensors and dequantizes them to the model's
dtype, on the CPU and, as a first step, on the GPU too (no in-register MXFP4 GEMM yet).
"""

from __future__ import annotations

import torch

# the 16 e2m1 codes: sign bit 3, then exponent and mantissa
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
BLOCK_BYTES = 16  # 32 values a scale


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """ValueError naming the projection `name` where its blocks and scales are not MXFP4's
    (dtypes are checked where they are known: not on `meta`)."""
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"MXFP4 tensor {name}_blocks: expected [..., groups, {BLOCK_BYTES}] bytes, "
            f"got shape {tuple(blocks.shape)}"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 tensor {name}_scales: shape {tuple(scales.shape)} does not match its "
            f"blocks' groups {tuple(blocks.shape[:-1])}"
        )
    for suffix, tensor in (("blocks", blocks), ("scales", scales)):
        if not tensor.is_meta and tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 tensor {name}_{suffix}: expected uint8, got {tensor.dtype}")


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [*prefix, G, 16] uint8
    scales: torch.Tensor,  # [*prefix, G] uint8 (E8M0)
    dtype: torch.dtype,
    name: str = "weight",
) -> torch.Tensor:  # [*prefix, G * 32] in dtype
    """The weight the blocks and scales encode (exact in float32 and bf16: FP4 values have
    2 significant bits; a product underflowing the dtype rounds as `ldexp` does)."""
    check_mxfp4(blocks, scales, name)
    *prefix, groups, _ = blocks.shape
    if blocks.is_meta:
        return torch.empty((*prefix, groups * 2 * BLOCK_BYTES), dtype=dtype, device="meta")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [*prefix, G, 32]
    exponents = scales.to(torch.int32) - 127
    weight = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return weight.flatten(-2).to(dtype)
