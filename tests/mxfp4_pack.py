"""MXFP4 packing for tests, written from the format (OCP MX: e2m1 values in groups of 32
with an E8M0 power of two), independent of the loader's and the kernels' code."""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of FP4 e2m1


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., cols] -> (blocks [..., cols / 32, 16] uint8, scales [..., cols / 32] uint8,
    the weight they encode [..., cols]): per 32 columns the power of two that brings the
    largest magnitude within 6, each value rounded to the nearest e2m1 magnitude with its
    sign bit (8), two codes a byte, the even column low."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # [..., G]
    scaled = groups / torch.exp2(exponent)[..., None]
    # the nearest magnitude, ties to the smaller (the midpoints between neighbours); on w's
    # device, no [..., 8] distance tensor (a 20B layer's experts are 0.5G weights)
    table = E2M1.to(w.device)
    magnitude = torch.bucketize(scaled.abs(), (table[1:] + table[:-1]) / 2)  # [..., G, 32] 0..7
    codes = magnitude | ((scaled < 0).long() << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    sign = torch.where(scaled < 0, -1.0, 1.0)
    encoded = sign * table[magnitude] * torch.exp2(exponent)[..., None]
    return blocks, (exponent + 127).to(torch.uint8), encoded.flatten(-2)
