"""Which kernels run a layer's small ops (RMSNorm, rotary, SiLU-and-mul): one Triton kernel
each on CUDA (`pagellm/kernels/fused.py`), one C++ loop each on the CPU
(`pagellm/kernels/cpu_fused.py`); None: the plain torch ops, the reference path
(PAGELLM_CPU_FUSED_OPS=0, or no compiler). Layers call these through the module
(`fused_ops.ops_for(x)`), so a test can swap them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagellm.kernels import cpu_fused
from pagellm.quantization.base import QuantizedWeight


@functools.cache
def triton_ops():
    try:
        from pagellm.kernels import fused
    except ImportError:  # no Triton: plain torch everywhere
        return None
    return fused


def ops_for(x: torch.Tensor):
    """The fused ops for x's device: Triton's on CUDA, the C++ ones on the CPU (float32 and
    bf16, where they could be built); None: the torch path."""
    if x.is_cuda:
        return triton_ops()
    if cpu_fused.supports(x):
        return cpu_fused
    return None


def fp8_input_group(x: torch.Tensor, columns: int, quant_for: Any) -> int | None:
    """The fp8 quantization (`QuantizedWeight.input_quantization`) that `quant_for`, the
    weight of the GEMM after this op, wants for an input of x's rows and `columns` columns,
    where the op's Triton kernel can write it (2-D x, whole groups); None: hand it x as it
    is. (Weights that take fp8 input run Triton kernels themselves: CUDA, or the
    interpreter in tests.)"""
    if not isinstance(quant_for, QuantizedWeight) or x.dim() != 2 or x.stride(-1) != 1:
        return None
    group = quant_for.input_quantization(x.shape[0])
    if group is None or (group and columns % group) or triton_ops() is None:
        return None
    return group
