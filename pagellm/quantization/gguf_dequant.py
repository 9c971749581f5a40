"""GGUF tensor bytes to float32 torch tensors.

The common llama.cpp block formats (Q4_0, Q4_1, Q8_0, BF16) are decoded with torch ops, which
use all cores and are ~10x faster than `gguf.quants.dequantize` (numpy); the results are
bit-identical (same float32 operations in the same order). Every other format (K-quants,
IQ*) goes through `gguf.quants.dequantize`.

Block layouts (32 weights per block; d, m: float16):
    Q4_0: d | 16 bytes of nibbles     w = d * (q - 8)
    Q4_1: d | m | 16 bytes of nibbles w = d * q + m
    Q8_0: d | 32 int8                 w = q * d
Nibble byte i holds weight i (low 4 bits) and weight i + 16 (high 4 bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType


def dequantize(tensor: Any) -> torch.Tensor:
    """Decode one GGUF tensor (`qtype`, `data`, `shape`: a `GGUFTensor` of
    `pagellm/loader/gguf_file.py`) to float32 with shape `tensor.shape`."""
    decode = _TORCH_DECODERS.get(tensor.qtype)
    if tensor.data.dtype != np.uint8:  # plain F32 / F16 / integer storage
        return torch.from_numpy(tensor.data).to(torch.float32)
    if decode is None:
        return torch.from_numpy(gguf_dequantize(tensor.data, tensor.qtype))
    raw = torch.from_numpy(tensor.data)
    return decode(raw.reshape(-1, _BLOCK_BYTES[tensor.qtype])).reshape(tensor.shape)


def q4_parts(blocks: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks [n, 18 | 20] uint8 as (q uint8 [n, 32] in 0..15, d, m float32
    [n, 1]) with w = q * d + m (Q4_0: m = -8 d)."""
    if qtype == Q.Q4_0:
        d = _half(blocks[:, :2])
        return _nibbles(blocks[:, 2:]), d, d * -8.0
    return _nibbles(blocks[:, 4:]), _half(blocks[:, :2]), _half(blocks[:, 2:4])


def decode_blocks(blocks: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Blocks [n, bytes] of a torch-decoded format -> float32 [n, weights per block]."""
    return _TORCH_DECODERS[qtype](blocks)


def block_bytes(qtype: Q) -> int | None:
    """Bytes of one 32-weight block of a torch-decoded format (None for the others)."""
    return _BLOCK_BYTES.get(qtype)


def _half(raw: torch.Tensor) -> torch.Tensor:
    # raw: [n, 2] uint8 -> [n, 1] float32
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # qs: [n, 16] uint8 -> [n, 32] uint8, low nibbles then high nibbles
    out = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
    return out


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [n, 18] -> [n, 32]
    q = _nibbles(blocks[:, 2:]).to(torch.int8).sub_(8)
    return q.to(torch.float32).mul_(_half(blocks[:, :2]))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [n, 20] -> [n, 32]
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return q.mul_(_half(blocks[:, :2])).add_(_half(blocks[:, 2:4]))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [n, 34] -> [n, 32]
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q.mul_(_half(blocks[:, :2]))


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [n, 2] -> [n, 1]
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


_TORCH_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.BF16: _bf16}
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34, Q.BF16: 2}
