"""GGUF blocks times float activations on the CPU (`pagellm/csrc/gguf_gemm.cpp`).

`block_gemm(x, BlockPlanes.from_blocks(blocks, qtype))` is `F.linear(x, dequantized
weight)` for a few rows of x (float32 or bfloat16), reading the file's Q4_0 / Q4_1 / Q8_0
values as they are (split into planes of integers and fp16 scales, bit for bit): a quarter
(Q4) or about half (Q8_0) of a bf16 weight's bytes, with exact products (float32, or bf16
pairs for bf16 x) accumulated in float32, so its results are the dequantized path's up to
summation order. Compiled on first use
(`pagellm.cpp_build`); `kernel()` is None where that fails (no compiler), and callers take
torch's int4 path or dequantize.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import threading
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from pagellm import cpp_build, envs
from pagellm.utils import cpuinfo_flags

Q = GGMLQuantizationType
QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # what the kernel reads
MAX_ROWS = 8  # rows of x one kernel call takes
BLOCK = 32  # weights per block
logger = logging.getLogger(__name__)
_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


@dataclass
class BlockPlanes:
    """A GGUF block tensor split into the kernel's planes, bit for bit (w = d * q + m)."""

    qs: torch.Tensor  # Q4: [N, K / 2] uint8 nibbles; Q8: [N, K] int8
    d: torch.Tensor  # [N, ceil(K / 32 / group_blocks)] float16
    m: torch.Tensor | None  # Q4: as d, float16 (Q4_0: -8 d) or float32; Q8: None
    # Q4: x rounded to int8 blocks before the products (None: PAGELLM_CPU_INT8_ACTIVATIONS)
    int8_activations: bool | None = None
    # blocks that share one d (and m): a GPTQ / AWQ group of 32 x group_blocks inputs, its
    # scale read once (GGUF files: 1, a scale a block)
    group_blocks: int = 1

    def __post_init__(self) -> None:
        q4 = self.m is not None
        n, k = self.qs.shape[0], self.qs.shape[1] * (2 if q4 else 1)
        groups = -(-k // (BLOCK * self.group_blocks))  # the last may be shorter
        if not 1 <= self.group_blocks <= 1 << 20 or k % BLOCK:
            raise ValueError(f"BlockPlanes: K = {k}, {self.group_blocks} blocks a group")
        if self.d.shape != (n, groups) or (q4 and self.m.shape != self.d.shape):
            raise ValueError("BlockPlanes: qs, d and m disagree on [N, K]")
        planes = (self.qs, self.d) + ((self.m,) if q4 else ())
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in planes):
            raise ValueError("BlockPlanes: the planes must be contiguous CPU tensors")
        self.shape = (n, k)
        # the kernel's arguments after x: kind, qs, d, m, N (read on every call); kind 2: Q4
        # with float32 offsets (GPTQ / AWQ groups, whose -zero * scale fp16 would round)
        kind = (2 if self.m.dtype == torch.float32 else 0) if q4 else 1
        kind |= self.group_blocks << GROUP_SHIFT if self.group_blocks > 1 else 0
        if self.int8_activations is None:
            self.int8_activations = envs.cpu_int8_activations()
        if q4 and self.int8_activations and int8_dots_supported():
            kind |= INT8_ACTIVATIONS
        self._args = (kind, self.qs.data_ptr(), self.d.data_ptr(),
                      self.m.data_ptr() if q4 else None, n)  # fmt: skip

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: GGMLQuantizationType) -> BlockPlanes:
        """blocks: [N, K / 32 * block bytes] uint8, one row of blocks per output row."""
        if qtype not in _BYTES or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(f"GGUF blocks of {qtype!r} as uint8 [N, bytes] are not supported")
        n = blocks.shape[0]
        b = blocks.reshape(n, -1, _BYTES[qtype])  # [N, K / 32, bytes]
        d = b[..., :2].contiguous().view(torch.float16).reshape(n, -1)
        if qtype == Q.Q8_0:
            return cls(b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), d, None)
        if qtype == Q.Q4_1:
            m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
            return cls(b[..., 4:].reshape(n, -1).contiguous(), d, m)
        return cls(b[..., 2:].reshape(n, -1).contiguous(), d, d * -8.0)  # Q4_0: exact


INT8_ACTIVATIONS = 4  # the kernel's kind bit: x rounded to int8 blocks (Q4 kinds)
GROUP_SHIFT = 8  # the kernel's kind carries group_blocks above this bit


@functools.cache
def int8_dots_supported() -> bool:
    """Whether the kernel multiplies x rounded to int8 here (AVX512-VNNI); logged once."""
    ok = supported() and {"avx512_vnni", "avx512bw", "avx512vl", "avx512dq"} <= cpuinfo_flags()
    if ok:
        logger.info("CPU 4-bit GEMMs round activations to int8 blocks of 32 (llama.cpp's "
                    "numerics), PAGELLM_CPU_INT8_ACTIVATIONS=1")  # fmt: skip
    else:
        logger.warning("PAGELLM_CPU_INT8_ACTIVATIONS=1 needs AVX512-VNNI; this CPU has none: "
                       "exact products")  # fmt: skip
    return ok


def supported() -> bool:
    """Whether GGUF blocks run fast here: an x86 CPU with AVX-512, or AVX2 with FMA (the
    kernel's vector paths; elsewhere it compiles to scalar code), where the kernel builds."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpuinfo_flags()
    vectors = "avx512f" in flags or {"avx2", "fma"} <= flags
    return x86 and vectors and kernel() is not None


@functools.cache
def kernel():
    """`pagellm_gguf_gemm`, or None where it cannot be built here (logged once)."""
    c = ctypes
    args = [c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_void_p, c.c_void_p]
    args += [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p]
    return cpp_build.entry_point(
        "gguf_gemm", "pagellm_gguf_gemm", args, c.c_int, "GGUF files are dequantized"
    )


@functools.cache
def greedy_kernel():
    """`pagellm_greedy_argmax` (the Q8 pass, the bound and the exact rows of
    `pagellm.sample.greedy_head`), or None where the library cannot be built here."""
    c = ctypes
    args = [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p]
    args += [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p]
    return cpp_build.entry_point(
        "gguf_gemm", "pagellm_greedy_argmax", args, c.c_int, "greedy steps compute the logits"
    )


@functools.cache
def dequant_kernel():
    """`pagellm_gguf_dequant` (planes to a dense [N, K] float32 / bfloat16 weight), or None."""
    c = ctypes
    args = [c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p]
    return cpp_build.entry_point(
        "gguf_gemm", "pagellm_gguf_dequant", args + [c.c_int], c.c_int, "weights are copied"
    )


_X_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_scratch = threading.local()  # per thread: {dtype: the largest weight dequantized so far}


def dequantize_into_scratch(w: BlockPlanes, dtype: torch.dtype) -> torch.Tensor:
    """The planes' weight [N, K] in `dtype` (float32 or bfloat16), written into a buffer this
    thread reuses for every layer (its size the largest layer's): valid until the next call;
    other dtypes (float16): the float32 weight converted, a new tensor. For batches beyond the
    blocks' rows where no dequantized copy is kept (`GGUFBlockWeight`)."""
    fn = dequant_kernel()
    if fn is None:
        raise ValueError("dequantize_into_scratch: the GGUF block kernel is not available")
    x_kind = _X_KINDS.get(dtype)
    if x_kind is None:
        return dequantize_into_scratch(w, torch.float32).to(dtype)
    n, k = w.shape
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n * k:
        buf = buffers[dtype] = torch.empty(n * k, dtype=dtype)
    out = buf[: n * k].view(n, k)
    kind, qs, d, m, _ = w._args
    if fn(kind, qs, d, m, n, k, out.data_ptr(), x_kind) != 0:
        raise ValueError("dequantize_into_scratch: the kernel refused its arguments")
    return out


def block_gemm(
    x: torch.Tensor,  # [M, K] float32 / bfloat16
    w: BlockPlanes,  # [N, K]
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w^T (+ bias), MAX_ROWS rows of x a kernel call (each row's result is the same
    whatever the others: they share the unpacking, not the sums). Called for every decode
    GEMM: the checks are the few a call needs (the planes were checked when built)."""
    gemm = kernel()
    m, k = x.shape
    x_kind = _X_KINDS.get(x.dtype)
    if gemm is None or x_kind is None or k != w.shape[1] or m < 1:
        raise ValueError(
            f"block_gemm: x {tuple(x.shape)} {x.dtype} against weight {w.shape}"
            + ("" if gemm else " (the GGUF block kernel is not available)")
        )
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.shape[0],)):
        raise ValueError("block_gemm: bias must be float32 [N]")
    x = x.contiguous()
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    y = torch.empty((m, w.shape[0]), dtype=x.dtype)
    x_ptr, y_ptr, x_row, y_row = x.data_ptr(), y.data_ptr(), k * x.element_size(), y.stride(0)
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        rc = gemm(
            x_ptr + start * x_row, rows, k, x_kind, *w._args,
            y_ptr + start * y_row * y.element_size(), bias_ptr,
        )  # fmt: skip
        if rc != 0:
            raise ValueError("block_gemm: the kernel refused its arguments")
    return y
