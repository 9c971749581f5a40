"""CUDA graphs for decode-only steps.

`CudaGraphRunner` captures one graph per batch size of a ladder, over the persistent buffers
of `StepInputs` (`step_inputs.py`). A decode-only step with R requests replays the smallest
captured size B >= R; rows R..B are padding requests of one token each (`pad_decode`).

The Triton decode launch for a decode-only batch needs no tile map (tile i is request i), so
nothing host-side changes between replays except the buffers' contents; its split-KV count
is fixed at capture (see `pagellm.attention.triton_backend`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of decode batch sizes: fine steps for small batches, 32 apart beyond 128."""
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, *range(160, max_num_seqs, 32)]
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


class CudaGraphRunner:
    """One CUDA graph per decode batch size; all share one memory pool."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden] the graph writes

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds `num_reqs` requests; None if none does."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self, forward: Callable[[int], torch.Tensor]) -> None:
        """forward(size): one padded decode forward of `size` tokens over the persistent
        buffers, returning [size, hidden]. Largest first, so smaller graphs reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            forward(size)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]
