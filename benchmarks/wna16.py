"""The W4A16 kernels (`pagellm/kernels/wna16_gemm.py`) at Llama-3.1-8B's projections against
torch's bf16 matmul (cuBLAS), and against the int4 weight-streaming bound (CUDA).

    python benchmarks/wna16.py                        # M = 1 (GEMV), 8 ... 256 (GEMM)
    python benchmarks/wna16.py --rows 1 4 --hbm-tb-s 4.8          # an H200
    python benchmarks/wna16.py --sweep --rows 1 16 64             # tiles: the best
    TRITON_INTERPRET=1 python benchmarks/wna16.py --tiny          # CPU: the same code path on
                                                                  # tiny shapes, checked only

For each projection (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336;
N x K) and row count M, int4 weights in groups of 128 (GPTQ's usual checkpoint: symmetric,
fp16-valued scales; the canonical layout the loader builds), timed as the median replay of a
CUDA graph over enough distinct weights (>= 2 GB) that none stays in L2:

- `int4_ms`: `wna16_gemm` (M <= 4: the GEMV streaming packed bytes on the CUDA cores; more
  rows: the tensor-core GEMM, tiles unpacked and scaled in registers);
- `bf16_ms`: `F.linear` on the bf16 weight of the same shape;
- `int4_gb_s`: bytes the int4 kernel must move (weight, scales, zeros, x, y) per second, and
  `of_bound`: that as a fraction of HBM bandwidth (`--hbm-tb-s`; 4.8 on an H200, else 3.35),
  the ceiling of a weight-streaming kernel (the issue's goal at batch 1: >= 0.70);
- `speedup`: bf16_ms / int4_ms (the ideal at batch 1 is ~3.6x: 4.25 bits a weight vs 16).

Each (projection, M) is first checked against x @ dequantized(w)^T. Rows for the whole
decoder layer (the four projections summed) close each M. The last line is one JSON object
with every number. `--tiny` runs on the CPU under Triton's interpreter on tiny shapes:
correctness of the path this script times, no speed claims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # projection: (N, K)
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336)},
    "tiny": {"qkv": (192, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256)},
}  # fmt: skip
GROUP = 128
ROWS = (1, 8, 16, 32, 64, 128, 256)


def random_int4(n: int, k: int, device: str):
    """(canonical qweight, scales, zeros) of random int4 weights, std ~ 1 / sqrt(k)."""
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k // GROUP, device=device) + 0.5) * (k**-0.5 / 4.6)
    zeros = torch.full((n, k // GROUP), 8, dtype=torch.uint8, device=device)
    return q, scales.half().float(), zeros


def moved_bytes(m: int, n: int, k: int) -> int:
    """What the int4 GEMM must read and write once: weight, scales, zeros, x, y."""
    return n * k // 2 + n * (k // GROUP) * 5 + 2 * m * (k + n)


def check(m: int, n: int, k: int, device: str, dtype: torch.dtype, config=None) -> float:
    """Max error of `wna16_gemm` against x @ dequantized(w)^T, relative to its largest entry."""
    from pagellm.kernels.wna16_gemm import wna16_gemm
    from pagellm.quantization.wna16_formats import dequantize

    q, s, z = random_int4(n, k, device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    want = F.linear(x.float(), dequantize(q, s, z, 4, GROUP))
    got = wna16_gemm(x, q, s, z, 4, GROUP, config=config).float()
    err = float((got - want).abs().max() / want.abs().max())
    if err > 2e-2:
        raise SystemExit(f"wna16_gemm M={m} N={n} K={k}: relative error {err:.3g}")
    return err


def time_pair(m: int, n: int, k: int) -> tuple[float, float]:
    """(int4 ms, bf16 ms) of one [m, k] x [n, k]^T product, weights rotated past L2."""
    from cuda_timing import graph_median_ms

    from pagellm.kernels.wna16_gemm import wna16_gemm

    ints = [random_int4(n, k, "cuda") for _ in range(max(1, int(2e9 // (n * k // 2))))]
    floats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
              for _ in range(max(1, int(2e9 // (n * k * 2))))]  # fmt: skip
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def run_int4():
        for q, s, z in ints:
            wna16_gemm(x, q, s, z, 4, GROUP)

    def run_bf16():
        for w in floats:
            F.linear(x, w)

    return graph_median_ms(run_int4, 7) / len(ints), graph_median_ms(run_bf16, 7) / len(floats)


def row(name: str, m: int, moved: int, int4_ms: float, bf16_ms: float, hbm: float) -> dict:
    """One result: times, the int4 kernel's GB/s and its fraction of HBM, the speedup."""
    gb_s = moved / int4_ms / 1e6
    return {"proj": name, "rows": m, "int4_ms": round(int4_ms, 4), "bf16_ms": round(bf16_ms, 4),
            "int4_gb_s": round(gb_s, 1), "of_bound": round(gb_s / (hbm * 1e3), 3),
            "speedup": round(bf16_ms / int4_ms, 2)}  # fmt: skip


def run_tiny(rows: list[int]) -> list[dict]:
    """The kernels on the CPU (TRITON_INTERPRET=1): checked, timed by the wall clock only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--tiny runs the kernels under Triton's interpreter: TRITON_INTERPRET=1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_kernels  # noqa: F401  (patches Triton 3.6's interpreter for numpy 2.4)

    results = []
    for name, (n, k) in SHAPES["tiny"].items():
        for m in rows:
            start = time.perf_counter()
            err = check(m, n, k, "cpu", torch.float32)
            if m <= 4:  # a sweep's tile too: K steps of several groups
                err = max(err, check(m, n, k, "cpu", torch.float32, GEMV_TILES[-1]))
            wall = (time.perf_counter() - start) * 1e3
            results.append({"proj": name, "rows": m, "N": n, "K": k, "rel_err": err,
                            "interpreter_ms": round(wall, 1)})  # fmt: skip
            print(f"{name:8s} M={m:4d} N={n:5d} K={k:5d}: rel err {err:.2e} ({wall:.0f} ms)")
    return results


def run_gpu(rows: list[int], hbm: float) -> list[dict]:
    results = []
    for m in rows:
        layer = [0.0, 0.0, 0]  # int4 ms, bf16 ms, bytes
        for name, (n, k) in SHAPES["llama-3.1-8b"].items():
            check(m, n, k, "cuda", torch.bfloat16)
            int4_ms, bf16_ms = time_pair(m, n, k)
            torch.cuda.empty_cache()
            r = row(name, m, moved_bytes(m, n, k), int4_ms, bf16_ms, hbm) | {"N": n, "K": k}
            layer = [layer[0] + int4_ms, layer[1] + bf16_ms, layer[2] + moved_bytes(m, n, k)]
            results.append(r)
            _print(r, hbm)
        results.append(row("layer", m, layer[2], layer[0], layer[1], hbm))
        _print(results[-1], hbm)
    return results


def _print(r: dict, hbm: float) -> None:
    print(f"{r['proj']:8s} M={r['rows']:4d}: int4 {r['int4_ms']:.4f} ms ({r['int4_gb_s']:7.1f} "
          f"GB/s, {r['of_bound']:.0%} of {hbm} TB/s), bf16 {r['bf16_ms']:.4f} ms, "
          f"{r['speedup']:.2f}x", flush=True)  # fmt: skip


GEMV_TILES = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
              for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (2, 4)
              if bn * bk <= 32768 and bn * bk >= 256 * w * 4]  # fmt: skip


def gemm_tiles(m: int) -> list[dict]:
    """Tensor-core GEMM candidates for M rows; the last: the first one with the float32
    unpack instead of 16-bit pairs (PAIRS=False), for comparison."""
    if m <= 16:
        tiles = [{"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": st}
                 for bn in (32, 64, 128) for bk in (64, 128) for st in (2, 4)]  # fmt: skip
    elif m >= 128:  # a decode step of many rows: fewer unpacks of each weight (taller tiles)
        tall = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": w, "num_stages": st}
                for bm in (128, 256) if bm <= m for bn in (64, 128) for w in (4, 8)
                for st in (3, 4) if bm * bn <= 128 * 128 or w == 8]  # fmt: skip
        tiles = [{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}]
        tiles += tall
    else:
        block_ms = [bm for bm in (32, 64, 128) if bm <= max(32, m)][-2:]
        tiles = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": w, "num_stages": 3}
                 for bm in block_ms for bn in (64, 128) for w in (4, 8)]  # fmt: skip
    return tiles + [tiles[0] | {"PAIRS": False}]


def time_config(x: torch.Tensor, ints: list, config: dict) -> float:
    """ms of one product with tiles `config`, over the rotated weights `ints`."""
    from cuda_timing import graph_median_ms

    from pagellm.kernels.wna16_gemm import wna16_gemm

    def run():
        for q, s, z in ints:
            wna16_gemm(x, q, s, z, 4, GROUP, config=config)

    return graph_median_ms(run, 5) / len(ints)


def sweep(m: int, hbm: float) -> dict:
    """Every candidate tile of the kernel M selects (GEMV or GEMM) at each projection, weights
    past L2: the default's and the best's GB/s per projection, and the best over the layer."""
    from pagellm.kernels import wna16_gemm
    from pagellm.kernels.wna16_gemm import gemm_config, gemv_config

    gemv = m <= wna16_gemm.GEMV_MAX_ROWS
    tiles = GEMV_TILES if gemv else gemm_tiles(m)
    totals, per_proj = [0.0] * len(tiles), {}
    for name, (n, k) in SHAPES["llama-3.1-8b"].items():
        ints = [random_int4(n, k, "cuda") for _ in range(max(1, int(2e9 // (n * k // 2))))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        default = gemv_config(n, k, 4, GROUP) if gemv else gemm_config(m, n, k)
        check(m, n, k, "cuda", torch.bfloat16, default)
        default_ms = time_config(x, ints, default)
        times = []
        for cfg in tiles:
            try:
                check(m, n, k, "cuda", torch.bfloat16, cfg)
                times.append(time_config(x, ints, cfg))
            except Exception as exc:  # a tile too large for the SM's registers / shared memory
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                times.append(float("inf"))
        totals = [a + b for a, b in zip(totals, times)]
        best = min(range(len(times)), key=times.__getitem__)
        gb_s = [moved_bytes(m, n, k) / t / 1e6 for t in (default_ms, times[best])]
        per_proj[name] = {"best": tiles[best], "best_ms": round(times[best], 4),
                          "default_ms": round(default_ms, 4)}  # fmt: skip
        print(f"{name:8s} M={m}: default {default} {default_ms:.4f} ms {gb_s[0]:.0f} GB/s; best "
              f"{tiles[best]} {times[best]:.4f} ms {gb_s[1]:.0f} GB/s "
              f"({gb_s[1] / (hbm * 1e3):.0%})", flush=True)  # fmt: skip
        ranked = sorted(range(len(times)), key=times.__getitem__)[:5]
        print("  top: " + "; ".join(f"{tiles[i]} {times[i]:.4f}" for i in ranked), flush=True)
        if not gemv:  # the last candidate: the first tile with the float32 unpack
            per_proj[name]["float32_unpack_ms"] = round(times[-1], 4)
            print(f"  float32 unpack, {tiles[0]}: {times[-1]:.4f} ms", flush=True)
        torch.cuda.empty_cache()
    best = min(range(len(totals)), key=totals.__getitem__)
    print(f"best over the layer at M={m}: {tiles[best]} {totals[best]:.4f} ms", flush=True)
    return {"rows": m, "layer_best": tiles[best], "layer_best_ms": round(totals[best], 4),
            "projections": per_proj}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument(
        "--hbm-tb-s",
        type=float,
        default=None,
        help="HBM bandwidth in TB/s (default: 4.8 on an H200, else 3.35: H100 SXM)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    ap.add_argument("--sweep", action="store_true", help="tiles at each M of --rows (CUDA)")
    ap.add_argument(
        "--gemv-max-rows",
        type=int,
        default=None,
        help="rows up to which the GEMV runs (the kernel module's GEMV_MAX_ROWS)",
    )
    args = ap.parse_args()
    if args.hbm_tb_s is None:
        h200 = torch.cuda.is_available() and "H200" in torch.cuda.get_device_name()
        args.hbm_tb_s = 4.8 if h200 else 3.35
    if args.gemv_max_rows is not None:
        from pagellm.kernels import wna16_gemm

        wna16_gemm.GEMV_MAX_ROWS = args.gemv_max_rows
    if args.sweep:
        for m in args.rows:
            print(json.dumps({"bench": "wna16-sweep", **sweep(m, args.hbm_tb_s)}))
        return
    if args.tiny:
        results = run_tiny(args.rows)
        device = "cpu (Triton interpreter)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --tiny with TRITON_INTERPRET=1)")
        results = run_gpu(args.rows, args.hbm_tb_s)
        device = torch.cuda.get_device_name()
    print(json.dumps({"bench": "wna16", "date": time.strftime("%Y-%m-%d"), "device": device,
                      "torch": torch.__version__, "group": GROUP, "hbm_tb_s": args.hbm_tb_s,
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
