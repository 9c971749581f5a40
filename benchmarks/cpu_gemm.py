"""CPU GEMMs of the embedded SmolLM2-135M's projections per weight format, interleaved A/B
(every format once per round, rounds repeated, medians): how `quantization="gguf" | "int4" |
"int8"` was chosen and where its row limit (PAGELLM_CPU_QUANT_MAX_ROWS) comes from.

    python benchmarks/cpu_gemm.py                       # M = 1, 2, 4, 8, 16; 1 thread
    python benchmarks/cpu_gemm.py --rows 1 --threads 2
    python benchmarks/cpu_gemm.py --rows 1 4 8 16 48 128 --threads 2    # bf16: where float32
                                                                        # arithmetic wins

Formats: float32 through MKL's packed sgemm, through oneDNN's and through our panels (the
engine times them at start-up and keeps the fastest: `pagellm/kernels/cpu_gemm.py`),
bfloat16 through oneDNN's packed layout and through our panels (`pagellm/csrc/panel_gemm.cpp`,
where the CPU has AVX512-BF16), bfloat16 in float32 arithmetic (the weight widened to float32, the
activations widened and the result rounded: the engine's bf16 path from 8 or 32 rows where
that start-up timing says it wins), int4 (groups of 32) and int8 (per row) through torch's
weight-only CPU kernels with bfloat16 activations, int4 with float32 activations (the
kernel's scalar path: why the activations are cast), and GGUF Q4_1 / Q8_0 blocks through our
block kernel (`pagellm/csrc/gguf_gemm.cpp`, float32 or bfloat16 activations, up to 8 rows).
One thread by default: on a shared machine a second thread mostly measures the neighbours. Ends with
one JSON line (microseconds per GEMM).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import gguf
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.kernels import panel_gemm
from pagellm.kernels.cpu_gemm import CpuGemmPlan, PackedWeight
from pagellm.quantization.cpu_int import quantize_int4, quantize_int8
from pagellm.quantization.gguf_kernel import MAX_ROWS, BlockPlanes, block_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip


def formats(n: int, k: int) -> dict:
    """name -> (fn(x), activation dtype) for one [n, k] weight."""
    w = torch.randn(n, k) * 0.02
    mkl, onednn = CpuGemmPlan("mkl"), CpuGemmPlan("onednn")
    fp32_mkl, fp32_onednn = PackedWeight(w, 256, mkl), PackedWeight(w, 256, onednn)
    bf16 = PackedWeight(w.bfloat16(), 256, mkl)
    widened = {lib: PackedWeight(w.bfloat16(), 256, CpuGemmPlan(lib, bf16_fp32_from_rows=1))
               for lib in ("mkl", "onednn")}  # fmt: skip
    q4, scale, low = quantize_int4(w, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 8)
    sz = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    sz_bf16 = sz.bfloat16()
    q8, s8 = quantize_int8(w)
    s8 = s8.bfloat16()
    int4mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    blocks = {qt: gguf_blocks(w, qt) for qt in (Q.Q4_1, Q.Q8_0)}
    panels = {dt: panel_gemm.Panels(w.to(dt)) for dt in (torch.float32, torch.bfloat16)
              if panel_gemm.supported(dt)}  # fmt: skip
    return {
        **{f"{str(dt)[6:]}_panels": (p, dt) for dt, p in panels.items()},
        "q4_1_blocks_fp32": (lambda x: block_gemm(x, blocks[Q.Q4_1]), torch.float32),
        "q4_1_blocks_bf16": (lambda x: block_gemm(x, blocks[Q.Q4_1]), torch.bfloat16),
        "q8_0_blocks_fp32": (lambda x: block_gemm(x, blocks[Q.Q8_0]), torch.float32),
        "fp32_mkl": (fp32_mkl, torch.float32),
        "fp32_onednn": (fp32_onednn, torch.float32),
        "bf16_onednn": (bf16, torch.bfloat16),
        "bf16_fp32_arith_mkl": (widened["mkl"], torch.bfloat16),
        "bf16_fp32_arith_onednn": (widened["onednn"], torch.bfloat16),
        "int4_bf16act": (lambda x: int4mm(x, packed, 32, sz_bf16), torch.bfloat16),
        "int8_bf16act": (lambda x: torch._weight_int8pack_mm(x, q8, s8), torch.bfloat16),
        "int4_fp32act": (lambda x: int4mm(x, packed, 32, sz), torch.float32),
    }


def gguf_blocks(w: torch.Tensor, qtype) -> BlockPlanes:
    """w [N, K] as GGUF blocks (gguf's own quantizer), in the kernel's planes."""
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype)).view(w.shape[0], -1)
    return BlockPlanes.from_blocks(raw, qtype)


def measure(fn, x: torch.Tensor, seconds: float) -> float:
    fn(x)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(x)
        reps += 1
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.05, help="per format per round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = {}
    for name, (n, k) in SHAPES.items():
        cands = formats(n, k)
        for m in args.rows:
            xs = {f: torch.randn(m, k).to(dt) for f, (_, dt) in cands.items()}
            times = {f: [] for f in cands}
            for _ in range(args.rounds):  # A B C ... A B C ...
                for f, (fn, _) in cands.items():
                    if f == "int4_fp32act" and m > 1:
                        continue  # scalar path: one row tells the story
                    if "blocks" in f and m > MAX_ROWS:
                        continue
                    times[f].append(measure(fn, xs[f], args.seconds))
            cell = {f: round(statistics.median(t), 1) for f, t in times.items() if t}
            table[f"{name} M={m}"] = cell
            print(f"{name:8s} M={m:<3d}" + "  ".join(f"{f} {v:8.1f}us" for f, v in cell.items()),
                  flush=True)  # fmt: skip
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "torch": torch.__version__, "us": table,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
