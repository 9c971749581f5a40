"""Programmatic dependent launch (PDL, Hopper and later) for the batch-1 decode chain.

A decode step at batch 1 is ~330 small kernels in a CUDA graph; between two of them the GPU
idles ~1.5 us while the next grid launches and its first loads travel to HBM and back
(docs/notes.md: ~0.5 ms of a 3.3 ms Llama-3.1-8B fp8 token). With PDL a kernel asks to
launch its successor early (`launch_dependents`, here at its start), and the successor,
launched with `launch_pdl=True`, starts at once: its launch overlaps the predecessor's
tail, and it may do work that needs nothing from it before it waits in `gdc_wait` until
the predecessor has finished and its writes are visible. So everything that reads the
predecessor's output, or writes anything, comes after `gdc_wait`.

Who does what: the one-row fp8 GEMVs (`fp8_gemm._fp8_gemv_kernel`, `_fp8_gemv_qkv_kernel`)
are launched with PDL and wait for their predecessor before their loop (loading a first
weight tile before the wait cost 7% at batch 1: docs/notes.md); the kernels that
precede GEMVs in a layer (RMSNorm, SiLU-and-mul, paged attention and its split combine) call
`launch_dependents`. RMSNorm is launched with PDL too, after o_proj's and down_proj's
GEMVs, which call `launch_dependents` at their start: its one program loads the norm weight,
waits, then lets the next GEMV launch (+2.9% at batch 1). Launching attention and its
combine early the same way (after the q | k | v GEMV) gained nothing and was left out; so
was gate | up's `launch_dependents`: the down GEMV's programs, waiting, took its SM slots.
Both instructions are no-ops for kernels launched without PDL. `enabled` is False on the
CPU (Triton's interpreter has no PTX), before Hopper, and with PAGELLM_PDL=0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagellm import envs


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL (its compile-time switch and launch option)."""
    return device.type == "cuda" and _capable(device.index or 0)


@functools.cache
def _capable(index: int) -> bool:
    return envs.pdl() and torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the kernel after this one launch now (it still waits for our writes)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()
