"""Our CPU GEMMs for bf16 (AVX512-BF16) and float32 (AVX-512, or AVX2 + FMA) weights
(`pagellm/csrc/panel_gemm.cpp`).

`Panels(weight)(x, bias)` is `F.linear(x, weight, bias)`, the weight re-laid once into panels
of 32 output rows: for bf16, column pairs side by side (the operands of `vdpbf16ps`); for
float32, one column after another (of an FMA). Exact products (bf16) or FMAs (float32),
float32 sums, one rounding to the output dtype: the arithmetic of oneDNN's and MKL's kernels
in another summation order. At decode sizes it streams the weights at about twice their rate
on the machines measured; `pagellm.kernels.cpu_gemm` times it against them at start-up and
uses it where it is not slower. Compiled on first use (`pagellm.cpp_build`); the entry
points are None where that fails (no compiler).
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from pagellm import cpp_build
from pagellm.utils import cpuinfo_flags

PANEL = 32  # output rows per panel (the C++ kPanel)
# the CPU flags each dtype's kernel needs: any one of the sets
_FLAGS = {torch.bfloat16: [{"avx512_bf16"}], torch.float32: [{"avx512f"}, {"avx2", "fma"}]}
_SYMBOLS = {torch.bfloat16: "pagellm_bf16_gemm", torch.float32: "pagellm_f32_gemm"}


def supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """An x86 CPU with the instructions for `dtype`'s kernel, where the kernel builds."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpuinfo_flags()
    has = any(need <= flags for need in _FLAGS.get(dtype, []))
    return x86 and has and kernel(dtype) is not None


@functools.cache
def kernel(dtype: torch.dtype = torch.bfloat16):
    """The entry point for `dtype`'s weights, or None where it cannot be built (logged once)."""
    if dtype not in _SYMBOLS:
        return None
    c = ctypes
    args = [c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p]
    args += [c.c_void_p, c.c_int64]
    return cpp_build.entry_point(
        "panel_gemm", _SYMBOLS[dtype], args, c.c_int, "GEMMs stay in oneDNN / MKL"
    )


class Panels:
    """A weight [N, K] as the kernel's panels (rows past N zero): bf16 [ceil(N / 32), K / 2,
    32, 2] (K even), float32 [ceil(N / 32), K, 32]; called as
    `panels(x [T, K], bias [N] | None) -> [T, N]` in the weight's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        bf16 = weight.dtype == torch.bfloat16
        if weight.dtype not in _SYMBOLS or (bf16 and k % 2) or weight.device.type != "cpu":
            raise ValueError(
                f"Panels: a CPU bf16 (even K) or float32 weight, got {weight.dtype} {weight.shape}"
            )
        rows = -(-n // PANEL) * PANEL
        if rows != n:
            weight = torch.cat([weight, weight.new_zeros(rows - n, k)])
        if bf16:
            self.panels = weight.view(rows // PANEL, PANEL, k // 2, 2).transpose(1, 2)
        else:
            self.panels = weight.view(rows // PANEL, PANEL, k).transpose(1, 2)
        self.panels = self.panels.contiguous()
        self.shape, self.dtype = (n, k), weight.dtype
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (bias, float32 copy)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.dtype != self.dtype or x.shape[-1] != k:
            raise ValueError(f"Panels: x {tuple(x.shape)} {x.dtype} against {self.dtype} {n, k}")
        lead = x.shape[:-1]
        x = x.reshape(-1, k)
        if x.stride(-1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        y = torch.empty((x.shape[0], n), dtype=self.dtype)
        if x.shape[0]:
            rc = kernel(self.dtype)(
                x.data_ptr(), x.stride(0), x.shape[0], k, self.panels.data_ptr(), n,
                self._float_bias(bias), y.data_ptr(), n,
            )  # fmt: skip
            if rc != 0:
                raise ValueError(f"Panels: the kernel refused its arguments ({rc})")
        return y.view(*lead, n)

    def _float_bias(self, bias: torch.Tensor | None) -> int | None:
        """The bias as float32 (the kernel's), converted once per bias tensor."""
        if bias is None:
            return None
        if self._bias is None or self._bias[0] is not bias:
            if bias.shape != (self.shape[0],):
                raise ValueError(f"Panels: bias {tuple(bias.shape)} for {self.shape[0]} rows")
            self._bias = (bias, bias.detach().float().contiguous())
        return self._bias[1].data_ptr()
