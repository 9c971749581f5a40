"""Compile the Triton kernels a forward will meet side by side, before running it.

On a cold start the first forward met each kernel variant in turn and compiled it on the
spot: about ten compiles one after another, 5-7 s of the start-up on an H200 host. Inside
`compile_ahead()` a forward runs *dry*: a Triton launch whose variant is not compiled yet is
skipped (its outputs stay unwritten) and the variant goes to a thread pool to compile;
leaving the block waits for every compile. Triton's compiler spends most of its time
outside the GIL (MLIR passes in C++, ptxas in a subprocess), so the variants compile in
parallel; the real forward after the block finds each of them in the kernel's own cache.

The dry forward's results are garbage, so nothing may depend on them: run the model, not
the sampler (its sampled ids index other tensors). Kernels compiled before or during the
block launch normally, on whatever inputs the dry forward gives them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_ahead(device: torch.device, max_workers: int | None = None) -> Iterator[None]:
    """Within the block, uncompiled Triton kernels are queued for compilation, not launched."""
    from triton import knobs

    if device.type != "cuda" or knobs.runtime.jit_cache_hook is not None:
        yield  # nothing is compiled off the GPU; never replace someone else's hook
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    owner = threading.get_ident()  # only this thread's launches run dry
    queued: dict[tuple[int, str], Future] = {}

    def compile_variant(jit_function, specialization_data: str) -> None:
        torch.cuda.set_device(index)
        jit_function.preload(specialization_data)  # compiles into the kernel's cache

    def hook(*, key, fn, compile, **_) -> bool | None:
        if threading.get_ident() != owner:
            return None  # the pool's own compile, or another thread's launch: as usual
        variant = (id(fn.jit_function), key)
        if variant not in queued:
            queued[variant] = pool.submit(
                compile_variant, fn.jit_function, compile["specialization_data"]
            )
        return True  # not compiled here, not launched

    workers = max_workers or min(8, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="triton-compile")
    start = time.perf_counter()
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = None
        pool.shutdown(wait=True)
    for future in queued.values():
        future.result()  # a compile error surfaces here
    if queued:
        logger.info(
            "compiled %d Triton kernel variants in %.1f s (%d threads)",
            len(queued), time.perf_counter() - start, workers,
        )  # fmt: skip
