"""cuBLAS bf16 GEMMs of the decoder's projections at decode and prefill row counts (CUDA).

    python benchmarks/gemm.py

For Qwen3-0.6B and Llama-3.1-8B shapes, `F.linear(x [M, K], W [N, K])` at M = 1 ... 8192,
captured in a CUDA graph over enough distinct weights (~2 GB) that none stays in L2.
Prints time, TFLOP/s and weight-read TB/s per projection: the floor under a decode step's
GEMMs (memory-bound at small M) and a prefill step's (compute-bound).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_median_ms  # noqa: E402

SHAPES = {  # name: (K, N)
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144),
                   "down": (3072, 1024), "lm_head": (1024, 151936)},
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                     "down": (14336, 4096), "lm_head": (4096, 128256)},
}  # fmt: skip


def time_linear(m: int, k: int, n: int) -> float:
    """Median ms of one [m, k] x [n, k]^T product, weights rotated past L2."""
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(max(1, int(2e9 // (n * k * 2))))
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def run():
        for w in weights:
            F.linear(x, w)

    return graph_median_ms(run, replays=7) / len(weights)


def main() -> None:
    for model, shapes in SHAPES.items():
        for m in (1, 64, 256, 2048, 8192):
            cells, flops, ms_all = [], 0.0, 0.0
            for name, (k, n) in shapes.items():
                if name == "lm_head" and m > 256:
                    continue  # prefill computes logits for the last tokens only
                ms = time_linear(m, k, n)
                flops, ms_all = flops + 2 * m * k * n, ms_all + ms
                cells.append(f"{name} {ms * 1e3:.1f} us {2 * m * k * n / ms / 1e9:.0f} TF "
                             f"{n * k * 2 / ms / 1e9:.2f} TB/s")  # fmt: skip
            print(f"{model} M={m}: " + " | ".join(cells) + f" | all {flops / ms_all / 1e9:.0f} TF")


if __name__ == "__main__":
    main()
