"""Shared by the CUDA micro-benchmarks: time a function replayed from a CUDA graph."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_median_ms(fn: Callable[[], None], replays: int = 10) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph (run once before, so
    Triton compiles and allocations happen outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
