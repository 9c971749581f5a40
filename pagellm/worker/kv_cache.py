"""One rank's KV cache memory: how much a GPU can give it (the profiled peak of a full step
subtracted from `gpu_memory_utilization` of the device), and its zeroed per-layer tensors
(on the CPU in fresh anonymous memory, zeroed by the kernel on first touch)."""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagellm.kv_cache_size import gpu_kv_budget

logger = logging.getLogger(__name__)


class ProfiledMemory(NamedTuple):
    """A GPU's memory as the profiling step found it, in bytes (the runner keeps it: its
    `describe()` reports it, benchmarks/plan_check.py compares it with `pagellm plan`)."""

    budget: int  # for the KV cache
    peak: int  # torch's peak over the step: weights, buffers, activations, sampling
    not_torch: int  # what torch did not allocate: the CUDA context, NCCL
    total: int  # the card's


def profiled_kv_budget(
    device: torch.device, profile_run: Callable[[], None], utilization: float
) -> ProfiledMemory:
    """`utilization` of the GPU, less what is not ours, the peak of `profile_run` (a
    full-budget step), and a margin: bytes for the KV cache (`gpu_kv_budget`, which
    `pagellm plan` predicts with)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    profile_run()  # also compiles the Triton kernels (cached on disk by Triton)
    torch.cuda.synchronize(device)
    logger.info("profiling forward pass in %.1f s", time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    not_torch = total - free - torch.cuda.memory_reserved(device)
    budget = gpu_kv_budget(total, utilization, not_torch, peak)
    gib = 1 << 30
    logger.info(
        "profiled peak %.2f GiB, other %.2f GiB of %.1f GiB: KV budget %.2f GiB",
        peak / gib, not_torch / gib, total / gib, budget / gib,
    )  # fmt: skip
    return ProfiledMemory(budget, peak, not_torch, total)


def zeros_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's cache; one-byte (fp8) zeros through a byte view (no fp8 fill on every
    device)."""
    if device.type == "cpu":
        return lazily_zeroed(shape, dtype)
    if dtype.itemsize == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in fresh anonymous memory: the kernel maps its pages zeroed on
    first touch, so the cache costs nothing until blocks are used (`torch.zeros` writes all
    of a 2 GiB cache at start-up: 0.6-2 s on 2 cores)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
