"""CPU attention that reads the paged KV cache in place (`pagellm/csrc/paged_decode.cpp`).

Made for decodes, it takes any query row that attends to a prefix of its request's keys:
each decode, and each row of a prefill chunk (causal: the row at position t attends t + 1
keys, this step's written to the cache first), so one call per layer serves the whole
step. The torch backend's other path gathers every cached K/V row of a step's decodes into
a contiguous copy, then runs SDPA, and one SDPA call per prefill chunk: the copy is written
and read again, every layer, every step. This kernel walks each request's block table and
reads each key and value row once per query row, for every query head of its KV head
(GQA), in float32 from float32, bfloat16 or fp8 caches, with the sliding window, soft-cap
and attention sinks of the layer.

torch ships no paged CPU attention (its flash kernel wants contiguous K/V; flex attention
needs Inductor's compiler at run time), so the kernel is ours: one C++ file that includes
only ATen's thread pool, compiled on first use (`pagellm.cpp_build`) and called through
ctypes. No compiler, a failed build or PAGELLM_CPU_DECODE_KERNEL=0: `kernel()` is None and
attention takes the gather + SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from pagellm import cpp_build, envs
from pagellm.kv_cache_dtype import is_fp8

_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # and 2: fp8, read through a table


@functools.cache
def kernel():
    """`pagellm_paged_decode`, or None where it cannot be built here (logged once)."""
    if not envs.cpu_decode_kernel() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    args = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    args += [ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
    return cpp_build.entry_point(
        "paged_decode", "pagellm_paged_decode", args, None, "attention gathers its K/V for SDPA"
    )


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of every byte of an fp8 format."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32 / bfloat16, rows written
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], q's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # the same shape, strides and dtype
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    rows: torch.Tensor,  # [n] int64 rows of q / out, most keys first
    reqs: torch.Tensor,  # [n] int64 their requests
    lens: torch.Tensor,  # [n] int32 the keys each attends: its request's positions < lens[i]
    scale: float,  # on q.k (fp8: times k_scale)
    v_scale: float = 1.0,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's sink logit
) -> None:
    """Attention of rows of q over their requests' paged keys, into the same rows of `out`."""
    attend = kernel()
    if attend is None:
        raise RuntimeError("the CPU paged attention kernel is not available")
    layout = (q.dtype, q.shape[1:], q.stride(), out.dtype, out.shape[1:], out.stride(),
              key_cache.dtype, key_cache.shape, key_cache.stride(), value_cache.dtype,
              value_cache.shape, value_cache.stride(), block_table.dtype, block_table.stride(),
              window or 0, q.device, out.device, key_cache.device)  # fmt: skip
    args = _LAYOUTS.get(layout)  # per layer the same every step: checked once
    if args is None:
        _check(out, q, key_cache, value_cache, block_table)
        args = _LAYOUTS[layout] = _layout_args(q, out, key_cache, block_table, window)
    _check_rows(out, q, block_table, rows, reqs, lens)
    _check_sinks(sinks, q)
    strides, dims, table = args
    attend(
        out.data_ptr(), q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_table.data_ptr(), rows.data_ptr(), reqs.data_ptr(), lens.data_ptr(),
        rows.numel(), strides.data_ptr(), dims.data_ptr(),
        None if table is None else table.data_ptr(), scale, v_scale, soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip


# the kernel's stride and dimension arguments per checked layout of the tensors
_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}


def _layout_args(q, out, key_cache, block_table, window):
    fp8 = is_fp8(key_cache.dtype)
    table = _fp8_table(key_cache.dtype) if fp8 else None
    strides = torch.tensor(
        [*q.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3], block_table.stride(0)],
        dtype=torch.int64,
    )
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    c_kind = 2 if fp8 else _KINDS[key_cache.dtype]
    dims = torch.tensor(
        [q.shape[1], num_kv_heads, head_dim, key_cache.shape[1], window or 0, _KINDS[q.dtype],
         c_kind],
        dtype=torch.int32,
    )  # fmt: skip
    return strides, dims, table


def _check(out, q, key_cache, value_cache, block_table) -> None:
    if q.dtype not in _KINDS or out.dtype != q.dtype or q.dim() != 3 or out.dim() != 3:
        raise ValueError("q and out must be [num_tokens, num_heads, head_dim], float32 or bf16")
    if out.shape[1:] != q.shape[1:]:
        raise ValueError("q and out must be [num_tokens, num_heads, head_dim], float32 or bf16")
    if key_cache.dtype not in _KINDS and not is_fp8(key_cache.dtype):
        raise ValueError(f"unsupported KV cache dtype {key_cache.dtype}")
    same = key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    if key_cache.dim() != 4 or not same or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must be alike [blocks, block_size, H_kv, D]")
    if key_cache.shape[3] != q.shape[2] or q.shape[1] % key_cache.shape[2]:
        raise ValueError("q and the caches disagree on head_dim or the head grouping")
    if q.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("head_dim must be contiguous in q, out and the caches")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError("block_table must be int32 with contiguous rows")
    tensors = (out, q, key_cache, value_cache, block_table)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("the CPU paged attention kernel takes CPU tensors")


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) or sinks.stride(0) != 1:
        raise ValueError("sinks must be a contiguous float32 [num_heads] tensor")
    if sinks.device.type != "cpu":
        raise ValueError("the CPU paged attention kernel takes CPU tensors")


def _check_rows(out, q, block_table, rows, reqs, lens) -> None:
    """What changes every step: the row lists (their values are the caller's contract)."""
    if out.shape[0] != q.shape[0] or block_table.device.type != "cpu":
        raise ValueError("q and out must have the same rows; block_table must be on the CPU")
    if (rows.dtype, reqs.dtype, lens.dtype) != (torch.int64, torch.int64, torch.int32):
        raise ValueError("rows and reqs must be int64, lens int32")
    n = rows.shape
    if not (rows.is_contiguous() and reqs.is_contiguous() and lens.is_contiguous()):
        raise ValueError("rows, reqs and lens must be contiguous and of one length")
    if reqs.shape != n or lens.shape != n or rows.dim() != 1:
        raise ValueError("rows, reqs and lens must be contiguous and of one length")
    if rows.device.type != "cpu" or reqs.device.type != "cpu" or lens.device.type != "cpu":
        raise ValueError("the CPU paged attention kernel takes CPU tensors")
