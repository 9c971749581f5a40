"""Write one step's keys and values into the paged KV cache (Triton).

The flat batch's K and V, `[num_tokens, num_kv_heads, head_dim]`, go to the slots named by
`slot_mapping`: slot `s` is token `s % block_size` of physical block `s // block_size`.
A slot of -1 marks a padded token (CUDA-graph padding) and is skipped. An fp8 cache is
written quantized: `clamp(x / scale, -max, max)` rounded to nearest even, with the layer's
`kv_scale = [k_scale, v_scale]` read from the device (so CUDA graphs see scales set later).

One program copies one token: all its KV heads, keys and values, `num_kv_heads * head_dim`
elements each, as one 2-D tile. The cache rows are contiguous per token
(`[block_size, num_kv_heads, head_dim]` inside a block), so each store is one run of
`num_kv_heads * head_dim` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kv_cache_dtype import is_fp8


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_cb, stride_cs):
    """Where cache slot `slot` (int64) starts: token slot % BLOCK_SIZE of block slot //
    BLOCK_SIZE (strides in elements)."""
    return (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs


@triton.jit
def to_cache(x, scale_ptr, cache_dtype, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as the cache stores it: for an fp8 cache x / scale (the scale at `scale_ptr`),
    saturated and rounded to nearest even; else x in the cache's dtype."""
    if QUANT:
        x = tl.clamp(x.to(tl.float32) * (1.0 / tl.load(scale_ptr)), -FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def quant_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple:
    """(QUANT, the [2] scales, FP8_MAX) of a write into `kv_cache`: fp8 caches quantize
    (no scales given: 1.0); the scales are None for other caches."""
    if not is_fp8(kv_cache.dtype):
        return False, None, 448.0
    if kv_scale is None:
        kv_scale = torch.ones(2, dtype=torch.float32, device=kv_cache.device)
    return True, kv_scale, torch.finfo(kv_cache.dtype).max


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32/int64, -1 = skip
    kv_scale_ptr,  # [2] float32 k_scale, v_scale (QUANT only)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache stride between blocks (elements)
    stride_cs,  # cache stride between slots of a block
    stride_ch,  # cache stride between kv heads
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr = False,  # fp8 cache: divide by the scale, saturate, round
    FP8_MAX: tl.constexpr = 448.0,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    # [HEADS_PAD, HEAD_DIM] tiles
    src_k = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot_offset(slot, BLOCK_SIZE, stride_cb, stride_cs)
    dst += offs_h[:, None] * stride_ch + offs_d[None, :]
    cache = k_cache_ptr.dtype.element_ty
    k = to_cache(tl.load(src_k, mask=mask), kv_scale_ptr, cache, QUANT, FP8_MAX)
    v = to_cache(tl.load(src_v, mask=mask), kv_scale_ptr + 1, cache, QUANT, FP8_MAX)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _check_inputs(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] matching key "
            f"{tuple(key.shape)}, got {tuple(kv_cache.shape)}"
        )
    if key.dtype != value.dtype or (key.dtype != kv_cache.dtype and not is_fp8(kv_cache.dtype)):
        raise TypeError(
            f"key, value and kv_cache must share a dtype (or the cache be fp8), got "
            f"{key.dtype}, {value.dtype}, {kv_cache.dtype}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            "slot_mapping must be a 1-D int32/int64 tensor, got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but only {key.shape[0]} tokens"
        )
    if len({key.device, value.device, kv_cache.device, slot_mapping.device}) != 1:
        raise ValueError("key, value, kv_cache and slot_mapping must be on one device")
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1)")
    head_dim, block_size = key.shape[2], kv_cache.shape[2]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(
            f"head_dim ({head_dim}) and block_size ({block_size}) must be powers of two"
        )


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_actual_tokens] int64, -1 = padded token
    kv_scale: torch.Tensor | None = None,  # [2] float32 k_scale, v_scale; fp8 caches only
) -> None:
    """Scatter key/value rows into the cache (quantized if it is fp8; no scale: 1.0); only
    the first `len(slot_mapping)` tokens count."""
    _check_inputs(key, value, kv_cache, slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    quant, kv_scale, fp8_max = quant_args(kv_cache, kv_scale)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scale if quant else slot_mapping,  # a placeholder pointer when unused
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        QUANT=quant,
        FP8_MAX=fp8_max,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
