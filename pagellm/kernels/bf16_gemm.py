"""bf16 GEMMs on x86 CPUs with AVX512-BF16 (`pagellm/csrc/bf16_gemm.cpp`).

`Bf16Panels(weight)(x, bias)` is `F.linear(x, weight, bias)` for bf16 x and weight, the
weight re-laid once into panels of 32 output rows whose column pairs are the operands of
`vdpbf16ps`. Exact products, float32 sums, one rounding to bf16 (oneDNN's bf16 kernel's
arithmetic, in another summation order). At decode sizes it streams the weights at about
twice oneDNN's rate on the machines measured; `pagellm.models.cpu_gemm` times it against
oneDNN at start-up and uses it where it is not slower. Compiled on first use
(`pagellm.cpp_build`); `kernel()` is None where that fails (no compiler).
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from pagellm import cpp_build
from pagellm.utils import cpuinfo_flags

PANEL = 32  # output rows per panel (the C++ kPanel)


def supported() -> bool:
    """An x86 CPU with AVX512-BF16 where the kernel builds."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and "avx512_bf16" in cpuinfo_flags() and kernel() is not None


@functools.cache
def kernel():
    """`pagellm_bf16_gemm`, or None where it cannot be built here (logged once)."""
    c = ctypes
    args = [c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p]
    args += [c.c_void_p, c.c_int64]
    return cpp_build.entry_point(
        "bf16_gemm", "pagellm_bf16_gemm", args, c.c_int, "bf16 GEMMs stay in oneDNN"
    )


class Bf16Panels:
    """A bf16 weight [N, K] (K even) as the kernel's panels [ceil(N / 32), K / 2, 32, 2]
    (rows past N zero); called as `panels(x [T, K] bf16, bias [N] | None) -> [T, N] bf16`."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or k % 2 or weight.device.type != "cpu":
            raise ValueError(f"Bf16Panels: a CPU bf16 weight with an even K, got {weight.shape}")
        rows = -(-n // PANEL) * PANEL
        if rows != n:
            weight = torch.cat([weight, weight.new_zeros(rows - n, k)])
        self.panels = weight.view(rows // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()
        self.shape = (n, k)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (bias, float32 copy)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.dtype != torch.bfloat16 or x.shape[-1] != k:
            raise ValueError(f"Bf16Panels: x {tuple(x.shape)} {x.dtype} against [{n}, {k}]")
        lead = x.shape[:-1]
        x = x.reshape(-1, k)
        if x.stride(-1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        if x.shape[0]:
            rc = kernel()(
                x.data_ptr(), x.stride(0), x.shape[0], k, self.panels.data_ptr(), n,
                self._float_bias(bias), y.data_ptr(), n,
            )  # fmt: skip
            if rc != 0:
                raise ValueError(f"Bf16Panels: the kernel refused its arguments ({rc})")
        return y.view(*lead, n)

    def _float_bias(self, bias: torch.Tensor | None) -> int | None:
        """The bias as float32 (the kernel's), converted once per bias tensor."""
        if bias is None:
            return None
        if self._bias is None or self._bias[0] is not bias:
            if bias.shape != (self.shape[0],):
                raise ValueError(f"Bf16Panels: bias {tuple(bias.shape)} for {self.shape[0]} rows")
            self._bias = (bias, bias.detach().float().contiguous())
        return self._bias[1].data_ptr()
