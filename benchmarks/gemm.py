"""cuBLAS bf16 GEMMs of the decoder's projections at decode and prefill row counts (CUDA);
with `--fp8`, the fp8 weight GEMMs of `quantization="fp8"` against `torch._scaled_mm`.

    python benchmarks/gemm.py
    python benchmarks/gemm.py --fp8              # Llama-3.1-8B projections, M = 1, 16, 256
    python benchmarks/gemm.py --fp8-sweep        # M = 1: every GEMV tile config, the best
    python benchmarks/gemm.py --fp8-sweep --rows 16   # the weight-only tl.dot kernel at M = 16

`--fp8` times, per projection and M (activations already quantized where the path needs
them, so each cell is one GEMM): `torch._scaled_mm` with row-wise scales (cuBLAS; the goal
at M = 256 is >= 85% of its speed), our Triton kernel weight-only (bf16 x: the decode path,
goal >= 3.3 TB/s of weight streaming at M = 1) and w8a8 (fp8 x), the block-scaled Triton
kernel (Qwen3-FP8's 128x128 scales), the whole `Fp8Weight` call as the model runs it
(activation quantization included), and bf16 `F.linear` for reference. Ends with one JSON
line.

For Qwen3-0.6B and Llama-3.1-8B shapes, `F.linear(x [M, K], W [N, K])` at M = 1 ... 8192,
captured in a CUDA graph over enough distinct weights (~2 GB) that none stays in L2.
Prints time, TFLOP/s and weight-read TB/s per projection: the floor under a decode step's
GEMMs (memory-bound at small M) and a prefill step's (compute-bound).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

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


def without_pairs(fn):
    """fn() with fp8 tiles loaded as fp8 and converted by `.to()` (captured that way)."""
    from pagellm.kernels import fp8_convert

    fp8_convert.ENABLED = False
    try:
        return fn()
    finally:
        fp8_convert.ENABLED = True


def fp8_cases(m: int, k: int, n: int) -> dict:
    """Callables for one (M, K, N): every fp8 path and bf16, each over rotated weights."""
    from pagellm.kernels.fp8_gemm import fp8_gemm, gemm_config, quantize_fp8
    from pagellm.quantization.fp8 import Fp8Weight, quantize_weight_per_row

    count = max(1, int(2e9 // (n * k)))
    ws = [quantize_weight_per_row(torch.randn(n, k, device="cuda") * 0.02) for _ in range(count)]
    bscale = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_fp8(x)
    xqb, xsb = quantize_fp8(x, 128)
    wrapped = [Fp8Weight(q, s) for q, s in ws]
    dot_cfg = gemm_config(m, n, k, 0)  # the tl.dot kernel, also at M = 1
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count // 2 or 1)]
    return {
        "scaled_mm": lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1),
                                               out_dtype=torch.bfloat16) for q, s in ws],
        "triton_w8a16": lambda: [fp8_gemm(x, q, s) for q, s in ws],  # the GEMV at M = 1
        "triton_dot_w8a16": lambda: [fp8_gemm(x, q, s, config=dot_cfg) for q, s in ws],
        "triton_dot_w8a16_to": lambda: without_pairs(
            lambda: [fp8_gemm(x, q, s, config=dot_cfg) for q, s in ws]
        ),  # w loaded as fp8 and converted by .to()
        "triton_w8a8": lambda: [fp8_gemm(xq, q, s, x_scale=xs) for q, s in ws],
        "triton_block_w8a8": lambda: [fp8_gemm(xqb, q, bscale, x_scale=xsb) for q, _ in ws],
        "Fp8Weight": lambda: [w(x) for w in wrapped],
        "bf16": lambda: [F.linear(x, w) for w in bf16],
    }, {"bf16": len(bf16)}  # fmt: skip


def main_fp8() -> None:
    results = []
    for m in (1, 4, 16, 256):
        for name, (k, n) in SHAPES["llama-3.1-8b"].items():
            if name == "lm_head":
                continue  # stays bf16
            cases, counts = fp8_cases(m, k, n)
            row = {"M": m, "proj": name, "K": k, "N": n}
            for case, fn in cases.items():
                per = counts.get(case, len(fn()))
                ms = graph_median_ms(fn, replays=7) / per
                nbytes = n * k * (2 if case == "bf16" else 1)
                row[case] = {"us": round(ms * 1e3, 1), "TB/s": round(nbytes / ms / 1e9, 2),
                             "TFLOP/s": round(2 * m * k * n / ms / 1e9, 1)}  # fmt: skip
            results.append(row)
            print(" | ".join(f"{c} {v['us']} us {v['TB/s']} TB/s {v['TFLOP/s']} TF"
                             for c, v in row.items() if isinstance(v, dict)),
                  f"<- M={m} {name}", flush=True)  # fmt: skip
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "fp8": results}))  # fmt: skip


def main_fp8_sweep(m: int) -> None:
    """Weight-only tile configs per projection, best first: at M = 1 the GEMV's (and the
    tl.dot kernel's default), at M > 1 the tl.dot kernel's."""
    from pagellm.kernels.fp8_gemm import fp8_gemm, gemm_config, gemv_config
    from pagellm.quantization.fp8 import quantize_weight_per_row

    best = {}
    for name, (k, n) in SHAPES["llama-3.1-8b"].items():
        if name == "lm_head":
            continue
        ws = [quantize_weight_per_row(torch.randn(n, k, device="cuda") * 0.02)
              for _ in range(max(1, int(2e9 // (n * k))))]  # fmt: skip
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        configs = [gemm_config(m, n, k, 0)]
        for bn, bk, warps, unroll in itertools.product((2, 4, 8), (256, 512, 1024, 2048, 4096),
                                                       (1, 2, 4, 8), (False, True)):  # fmt: skip
            lane = bn * bk // (32 * warps)  # weight bytes a lane loads a step
            if m == 1 and 8 * bn <= lane <= 128 and k % bk == 0 and (not unroll or k // bk <= 8):
                configs.append(dict(GEMV=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                    num_stages=1, K_STEPS=k // bk if unroll else 0))  # fmt: skip
        for bn, bk, warps, stages in itertools.product((16, 32), (128, 256, 512), (2, 4), (3, 5)):
            if m > 1 and k % bk == 0:
                configs.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                    num_stages=stages))  # fmt: skip
        timings = []
        for cfg in configs:
            try:
                run = lambda x=x, ws=ws, cfg=cfg: [fp8_gemm(x, q, s, config=cfg) for q, s in ws]  # noqa: E731
                ms = graph_median_ms(run)
            except Exception as e:  # out of shared memory, ...
                print(f"{name} {cfg}: {type(e).__name__}")
                continue
            timings.append((ms / len(ws), cfg))
        timings.sort(key=lambda t: t[0])
        default = gemv_config(n, k, 0) if m == 1 else configs[0]
        for ms, cfg in timings[:4] + [t for t in timings if t[1] == configs[0]]:
            print(
                f"{name}: {n * k / ms / 1e9:.2f} TB/s {cfg}"
                + (" (default)" if cfg == default else "")
            )
        best[name] = {"TB/s": round(n * k / timings[0][0] / 1e9, 2), "config": timings[0][1]}
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                      f"fp8_sweep_m{m}": best}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--fp8-sweep", action="store_true")
    ap.add_argument("--rows", type=int, default=1, help="M of --fp8-sweep")
    args = ap.parse_args()
    if args.fp8:
        return main_fp8()
    if args.fp8_sweep:
        return main_fp8_sweep(args.rows)
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
