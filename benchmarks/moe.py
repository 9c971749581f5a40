"""The fused-MoE expert GEMMs against cuBLAS on the same work (CUDA, bf16; or int4 / fp8 / mxfp4
experts, `--weights`, against cuBLAS in bf16).

    python benchmarks/moe.py                              # Qwen3-30B-A3B shapes
    python benchmarks/moe.py --model mixtral-8x7b --tokens 1 64 256
    python benchmarks/moe.py --sweep                      # tile sweep: the best config per M
    python benchmarks/moe.py --weights int4               # int4 experts (groups of 128)
    python benchmarks/moe.py --weights fp8 --tokens 1 64  # fp8 experts (128 x 128 blocks)
    python benchmarks/moe.py --model gpt-oss-20b --weights mxfp4  # MXFP4 experts
    python benchmarks/moe.py --model gpt-oss-20b --weights mxfp4 --tokens 1 2 4 --gemv-sweep

For each token count T, routing comes from random router logits (softmax, top-k, as the
model routes). Timed, each as the median replay of a CUDA graph over enough layers' weights
(>= 3 GB) that no expert stays in L2:

- `fused_ms`: `fused_moe` (align by expert, gate_up GEMM + SiLU-and-mul, down GEMM times the
  routing weights, sum over top-k), given the routing;
- `gemm_ms`: the two grouped GEMMs alone, on a precomputed layout;
- `cublas_ms`: cuBLAS on the same total FLOPs and the same weight bytes: a batched matmul
  over the A experts the routing hits, each with ceil(T * top_k / A) rows (a perfectly
  balanced grouped GEMM), gate_up then down;
- `gemv_ms` (int4 / mxfp4 experts, T * top_k <= GEMV_MAX_ROWS): `fused_moe_quant`'s default
  there, the decode path of `fused_moe_gemv.py` (no layout, one program a row); `fused_ms`
  is then the tiled kernel forced by its config (quantized experts: the engine's tiles for
  them, `fused_moe_quant.default_config`).

`ratio` = cublas_ms / gemm_ms (the goal: >= 0.8 at decode sizes). TFLOP/s counts the real
rows' FLOPs; TB/s the active experts' weight bytes. `--sweep` times the GEMMs for every
candidate tile config per T, prints the best, and ends with the table to paste into
`pagellm/kernels/fused_moe.py: H200_CONFIGS` (`--weights mxfp4`: `fused_moe_quant.py:
MXFP4_CONFIGS`; keyed by rows per expert, T * top_k / E);
`--gemv-sweep` times the GEMV's candidate tiles (`fused_moe_gemv.gemv_config`).
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_median_ms  # noqa: E402

SHAPES = {  # name: (experts E, top_k, hidden H, expert intermediate I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
H200_PEAK = {"tflops": 989.0, "tb_s": 4.8}  # dense bf16 tensor cores, HBM3e
BYTES = {"bf16": 2, "fp8": 1, "int4": 0.5, "mxfp4": 0.5}  # an expert weight's (scales not counted)


class Problem:
    """Weights of `copies` layers, one routing of T tokens, and their expert layout."""

    def __init__(
        self, shape: tuple[int, int, int, int], tokens: int, seed: int = 0, kind: str = "bf16"
    ) -> None:
        from pagellm.layers.moe import select_experts

        e, k, h, i = shape
        torch.manual_seed(seed)
        layer_bytes = e * 3 * i * h * 2
        self.copies = max(1, math.ceil(3e9 / layer_bytes))
        self.weights = [
            (torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h**-0.5,
             torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i**-0.5)
            for _ in range(self.copies)
        ]  # fmt: skip
        self.kind = kind  # int4 / fp8: the quantized copies the fused kernels read
        self.quantized = []
        if kind != "bf16":
            copies = max(1, math.ceil(3e9 / (layer_bytes * BYTES[kind] / 2)))
            self.quantized = [
                (quantized_stack(e, 2 * i, h, kind), quantized_stack(e, h, i, kind))
                for _ in range(copies)
            ]
        self.x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, e, device="cuda", dtype=torch.float32)
        self.topk_weights, self.ids = select_experts(logits, k, renormalize=True)
        self.shape, self.tokens = shape, tokens
        self.active = int(torch.unique(self.ids).numel())

    @property
    def flops(self) -> float:
        e, k, h, i = self.shape
        return 2.0 * self.tokens * k * (h * 2 * i + i * h)

    @property
    def weight_bytes(self) -> float:
        e, k, h, i = self.shape
        return self.active * 3.0 * i * h * BYTES[self.kind]


def quantized_stack(e: int, n: int, k: int, kind: str):
    """Random experts [E, N, K] as the quantized kernels read them: int4 groups of 128
    (symmetric, GPTQ's usual), or fp8 with 128 x 128 block scales (Qwen3-30B-A3B-FP8's)."""
    from pagellm.kernels.fused_moe_quant import QuantizedStack

    if kind == "mxfp4":  # gpt-oss's: e2m1 codes, a power of two a group of 32 (about k**-0.5)
        q = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
        top = 127 + round(math.log2(k**-0.5 / 3))
        scales = torch.randint(top - 1, top + 1, (e, n, k // 32), device="cuda").to(torch.uint8)
        return QuantizedStack(q, scales, None, 4, 32, mxfp4=True)
    if kind == "int4":
        q = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
        scales = torch.full((e, n, k // 128), k**-0.5 / 4.6, device="cuda")
        zeros = torch.full((e, n, k // 128), 8, dtype=torch.uint8, device="cuda")
        return QuantizedStack(q, scales, zeros, 4, 128)
    q = (torch.randn(e, n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
    scales = torch.full((e, n // 128, k // 128), k**-0.5 / 64, device="cuda")
    return QuantizedStack(q, scales, None, 0, 128)


def time_fused(p: Problem, config) -> float:
    from pagellm.kernels.fused_moe import fused_moe
    from pagellm.kernels.fused_moe_quant import fused_moe_quant

    fused, weights = (fused_moe_quant, p.quantized) if p.quantized else (fused_moe, p.weights)

    def run():
        for w13, w2 in weights:
            fused(p.x, w13, w2, p.topk_weights, p.ids, config)

    return graph_median_ms(run) / len(weights)


def time_gemms(p: Problem, config) -> float:
    from pagellm.kernels.fused_moe import align_by_expert, moe_gemm
    from pagellm.kernels.fused_moe_quant import moe_gemm_quant

    e, k, h, i = p.shape
    layout = align_by_expert(p.ids, e, config.block_m)
    act = torch.empty(p.tokens * k, i, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(p.tokens * k, h, device="cuda", dtype=torch.bfloat16)
    flat_weights = p.topk_weights.view(-1)
    gemm, weights = (moe_gemm_quant, p.quantized) if p.quantized else (moe_gemm, p.weights)

    def run():
        for w13, w2 in weights:
            gemm(p.x, w13, act, layout, config, rows_per_a=k, gated=True)
            gemm(act, w2, y, layout, config, rows_per_a=1, routing_weights=flat_weights)

    return graph_median_ms(run) / len(weights)


def time_cublas(p: Problem) -> float:
    """Balanced batched matmuls over the active experts: the same FLOPs and weight bytes."""
    e, k, h, i = p.shape
    rows = math.ceil(p.tokens * k / p.active)
    a = torch.randn(p.active, rows, h, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(p.active, rows, i, device="cuda", dtype=torch.bfloat16)

    def run():
        for w13, w2 in p.weights:
            torch.bmm(a, w13[: p.active].transpose(1, 2))
            torch.bmm(act, w2[: p.active].transpose(1, 2))

    return graph_median_ms(run) / p.copies


def candidates(tokens: int, shape: tuple[int, int, int, int]):
    """Tile configs worth timing at this many rows per expert (BLOCK_M near the row count)."""
    from pagellm.kernels.fused_moe import MoEConfig

    e, k, _, _ = shape
    rows = tokens * k / e
    block_ms = (16, 32) if rows <= 16 else (32, 64) if rows <= 64 else (64, 128)
    for bm, bn, bk, group, stages in itertools.product(
        block_ms, (64, 128), (64, 128), (1, 8), (3, 4)
    ):
        smem = 2 * (bm * bk + 2 * bk * bn) * stages  # the gated GEMM's, bytes
        if smem <= 200 * 1024:
            yield MoEConfig(bm, bn, bk, group, 8 if bm * bn >= 128 * 128 else 4, stages)


def sweep(p: Problem) -> tuple[dict, float]:
    best, best_ms = None, float("inf")
    for config in candidates(p.tokens, p.shape):
        try:
            ms = time_gemms(p, config)
        except Exception as exc:  # out of shared memory or registers: not a candidate here
            print(f"  skip {config}: {type(exc).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best.__dict__, best_ms


def gemv_sweep(p: Problem) -> tuple[dict, float]:
    from pagellm.kernels.fused_moe_gemv import GemvConfig

    best, best_ms = None, float("inf")
    for bn, bk, warps in itertools.product((8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8)):
        config = GemvConfig(bn, bk, warps)
        ms = time_fused(p, config)
        print(f"  {config}: {ms:.4f} ms")
        if ms < best_ms:
            best, best_ms = config, ms
    return best.__dict__, best_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 2048, 8192])
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile config")
    ap.add_argument("--gemv-sweep", action="store_true", help="time the GEMV's candidate tiles")
    ap.add_argument("--weights", choices=sorted(BYTES), default="bf16",
                    help="int4 / fp8 / mxfp4 experts run fused_moe_quant.py")  # fmt: skip
    args = ap.parse_args()
    from pagellm.kernels.fused_moe import choose_config
    from pagellm.kernels.fused_moe_gemv import GEMV_MAX_ROWS
    from pagellm.kernels.fused_moe_quant import default_config

    shape = SHAPES[args.model]
    results = []
    for tokens in args.tokens:
        p = Problem(shape, tokens, kind=args.weights)
        # the engine's tiles: bf16's table, or the quantized experts' (MXFP4 has its own)
        config = p.quantized and default_config(tokens, shape[1], shape[0], p.quantized[0][0])
        config = config or choose_config(tokens, shape[1], shape[0])
        row = {"tokens": tokens, "active_experts": p.active, "config": config.__dict__}
        row["fused_ms"] = round(time_fused(p, config), 4)
        gemv = args.weights in ("int4", "mxfp4") and tokens * shape[1] <= GEMV_MAX_ROWS
        if gemv:
            row["gemv_ms"] = round(time_fused(p, None), 4)
            tb_s = p.weight_bytes / row["gemv_ms"] / 1e9
            print(f"T={tokens:5d}: GEMV {row['gemv_ms']:.4f} ms ({tb_s:.2f} TB/s), tiles "
                  f"{row['fused_ms']:.4f} ms")  # fmt: skip
        if gemv and args.gemv_sweep:
            row["best_gemv"], row["best_gemv_ms"] = gemv_sweep(p)
            print(f"T={tokens:5d}: best GEMV {row['best_gemv_ms']:.4f} ms {row['best_gemv']}")
        row["gemm_ms"] = gemm_ms = round(time_gemms(p, config), 4)
        row["cublas_ms"] = cublas_ms = round(time_cublas(p), 4)
        row["ratio"] = round(cublas_ms / gemm_ms, 3)
        row["tflops"] = round(p.flops / gemm_ms / 1e9, 1)
        row["weight_tb_s"] = round(p.weight_bytes / gemm_ms / 1e9, 2)
        if args.sweep:
            row["best_config"], best_ms = sweep(p)
            row["best_gemm_ms"] = round(best_ms, 4)
            row["best_rows_per_expert"] = tokens * shape[1] / shape[0]
        print(
            f"T={tokens:5d} active {p.active:3d}: fused {row['fused_ms']:.4f} ms, GEMMs "
            f"{gemm_ms:.4f} ms ({row['tflops']} TF/s, {row['weight_tb_s']} TB/s), cuBLAS "
            f"{cublas_ms:.4f} ms, ratio {row['ratio']}"
            + (f", best {row['best_gemm_ms']:.4f} ms {row['best_config']}" if args.sweep else "")
        )
        results.append(row)
        del p
        torch.cuda.empty_cache()
    if args.sweep:
        print("best by rows per expert (for H200_CONFIGS):")
        for row in results:
            fields = ", ".join(str(v) for v in row["best_config"].values())
            print(f"    ({row['best_rows_per_expert']:g}, MoEConfig({fields})),")
    summary = {
        "bench": "moe",
        "model": args.model,
        "weights": args.weights,
        "shape": dict(zip(("experts", "top_k", "hidden", "intermediate"), shape)),
        "device": torch.cuda.get_device_name(),
        "peak": H200_PEAK,
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
