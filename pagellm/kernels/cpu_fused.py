"""The decoder layer's small ops fused for the CPU (`pagellm/csrc/cpu_fused.cpp`): RMSNorm
(+ residual add), rotary, SiLU-and-mul.

The same functions, signatures and results as the Triton module `pagellm/kernels/fused.py`
(but its Qwen3 `qk_norm_rotary`: here the norm and the rotary, two calls each), so
`pagellm.layers.fused_ops` picks either for its device. In eager torch each op is 3-9
elementwise kernels of a few microseconds of dispatch; at a CPU decode step of a small model
those add up to as much as the attention (docs/notes.md). Rounding follows the torch
path op by op (the C++ file says where it may differ in the last bit). float32 and bfloat16;
the library is built on first use by `pagellm.cpp_build`. Without a compiler (or with
PAGELLM_CPU_FUSED_OPS=0) `available()` is False and the layers keep their torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from pagellm import cpp_build, envs

logger = logging.getLogger(__name__)

_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "pagellm_rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _F, ctypes.c_int],
    "pagellm_rotary": [_P, _P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_int],
    "pagellm_silu_and_mul": [_P, _P, _I64, _I64, _P, ctypes.c_int],
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not envs.cpu_fused_ops():
        return None
    try:
        lib = cpp_build.load("cpu_fused")
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel cpu_fused unavailable (%s): the layers' small ops stay torch", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def available() -> bool:
    return _library() is not None


def supports(x: torch.Tensor) -> bool:
    """Whether `x`'s ops can run here: a CPU tensor of float32 / bfloat16, the library built."""
    return x.device.type == "cpu" and x.dtype in _KINDS and available()


def _strides(*pairs: int) -> ctypes.Array:
    return (ctypes.c_int64 * len(pairs))(*pairs)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(token, head) strides of a [T, n] or [T, heads, n] tensor."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def rms_norm(
    x: torch.Tensor,  # [T, n] or [T, heads, n]; contiguous in n
    weight: torch.Tensor,  # [n], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, n]: added to x first (x must be 2-D)
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (normed like x, x + residual or None)
    n = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} (stride(-1) must be 1), weight {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype or not weight.is_contiguous() or x.dtype not in _KINDS:
        raise ValueError(
            f"rms_norm: x {x.dtype} and weight {weight.dtype} must match (float32 / bf16)"
        )
    if residual is not None and (
        x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1
        or residual.dtype != x.dtype
    ):  # fmt: skip
        raise ValueError("rms_norm: residual must match a 2-D x and be contiguous in its last dim")
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    res = residual if residual is not None else x
    tokens, heads = x.shape[0], x.shape[1] if x.dim() == 3 else 1
    strides = _strides(*_rows(x), *_rows(res), *_rows(res_out if res_out is not None else out),
                       *_rows(out))  # fmt: skip
    _library().pagellm_rms_norm(
        out.data_ptr(), None if res_out is None else res_out.data_ptr(), x.data_ptr(),
        None if residual is None else residual.data_ptr(), weight.data_ptr(),
        tokens, heads, n, strides, eps, _KINDS[x.dtype],
    )  # fmt: skip
    return out, res_out


def rotary(
    x: torch.Tensor,  # [T, heads, D]; contiguous in D, D even
    cos_sin: torch.Tensor,  # [T, 1, D]: cos | sin, in x's dtype
) -> torch.Tensor:  # [T, heads, D] contiguous
    t, heads, d = x.shape
    if x.stride(-1) != 1 or cos_sin.shape != (t, 1, d) or cos_sin.stride(-1) != 1:
        raise ValueError(f"rotary: x {tuple(x.shape)}, cos_sin {tuple(cos_sin.shape)}")
    if d % 2 or cos_sin.dtype != x.dtype or x.dtype not in _KINDS:
        raise ValueError(
            f"rotary: head_dim {d} must be even, dtypes {x.dtype} / {cos_sin.dtype} alike"
        )
    out = torch.empty(x.shape, dtype=x.dtype)
    strides = _strides(x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0))
    _library().pagellm_rotary(
        out.data_ptr(), x.data_ptr(), cos_sin.data_ptr(), t, heads, d // 2, d, strides,
        _KINDS[x.dtype],
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * n] (gate | up) -> [T, n]
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1 or x.dtype not in _KINDS:
        raise ValueError(f"silu_and_mul: expected [T, 2 * n] contiguous rows, got {tuple(x.shape)}")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype)
    strides = _strides(x.stride(0), out.stride(0))
    _library().pagellm_silu_and_mul(out.data_ptr(), x.data_ptr(), t, n, strides, _KINDS[x.dtype])
    return out


def supports_rotary(head_dim: int) -> bool:
    return head_dim % 2 == 0
