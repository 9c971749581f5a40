"""Shared by the CUDA micro-benchmarks: time a function replayed from a CUDA graph; paged
block tables per layer."""

from __future__ import annotations

import itertools
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


def layer_block_tables(blocks: list[int], layers: int) -> list[torch.Tensor]:
    """CUDA [len(blocks), max(blocks)] int32 block tables, one per layer: request i owns
    blocks[i] pages, every layer its own pages (layer l's are l * sum(blocks) on), shuffled,
    so no layer reads what an earlier one left in L2."""
    per_layer, tables = sum(blocks), []
    for layer in range(layers):
        perm = torch.randperm(per_layer) + layer * per_layer
        table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
        for i, start in enumerate(itertools.accumulate([0, *blocks[:-1]])):
            table[i, : blocks[i]] = perm[start : start + blocks[i]]
        tables.append(table.cuda())
    return tables
