"""The attention of one decode step of the standard workload, all layers, in a CUDA graph.

    python benchmarks/decode_step.py                  # Qwen3-0.6B shape (16/8 heads, 28 layers)
    python benchmarks/decode_step.py --model llama    # Llama-3.1-8B shape (32/8 heads, 32 layers)
    python benchmarks/decode_step.py --sweep          # also decode tile configs
    python benchmarks/decode_step.py --tiles 16/1/4,32/1/4  # only these (keys/warps/stages)
    python benchmarks/decode_step.py --sliding-window 512   # every layer windowed
    python benchmarks/decode_step.py --kv-cache-dtype fp8   # an fp8 cache: int16 pairs vs .to()
    python benchmarks/decode_step.py --block-size 32        # pages of 32 tokens

256 requests with seq_len = randint(100, 1024) + 256 (random.seed(0): the standard
workload's prompts, half-way through their outputs), head_dim 128, pages of 16 tokens, bf16;
`--model qwen3-30b` is Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, 48 layers).
Every layer has its own pages (block tables shuffled per layer, so no layer reads what an
earlier one left in L2); one CUDA graph replays the paged-attention launch of every layer,
as the engine's decode graphs do. Variants, timed in turns (A B C D, three times):
the page layout (token-major `[block, slot, kv_head, d]`, the engine's; head-major
`[block, kv_head, slot, d]` through strides) and the program order (request order, or
longest first: `order_by_length`). Reported as TB/s of K/V read (with --sliding-window W,
each request's last W keys); medians of the turns.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_median_ms, layer_block_tables  # noqa: E402

# heads, kv heads, layers: 2, 4 and 8 query heads a KV head
SHAPES = {"qwen": (16, 8, 28), "llama": (32, 8, 32), "qwen3-30b": (32, 4, 48)}
HEAD_DIM, BATCH = 128, 256


def main() -> None:
    from pagellm.kernels import fp8_convert
    from pagellm.kernels.attention_plan import decode_config, order_by_length, plan_attention
    from pagellm.kernels.paged_attention import _STAGES_THAT_FIT, paged_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen")
    p.add_argument("--sweep", action="store_true", help="block_n / warps / stages, longest first")
    p.add_argument("--quick-sweep", action="store_true", help="the sweep at 2 or 4 warps, 32+ keys")
    p.add_argument("--tiles", default="", help="only these, e.g. 16/1/4,32/1/4 (keys/warps/stages)")
    p.add_argument("--sliding-window", type=int, default=0, help="0: none")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"])
    p.add_argument("--block-size", type=int, default=16, help="tokens a page")
    args = p.parse_args()
    block_size = args.block_size
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(args.kv_cache_dtype)
    window = args.sliding_window or None
    heads, kv_heads, layers = SHAPES[args.model]

    rng = random.Random(0)
    lens = [rng.randint(100, 1024) + 256 for _ in range(BATCH)]
    blocks = [-(-n // block_size) for n in lens]
    per_layer = sum(blocks)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, per_layer * layers, block_size, kv_heads, HEAD_DIM)
    token_major = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    if fp8 is not None:
        token_major = token_major.to(fp8)
    head_major = token_major.transpose(2, 3).contiguous().transpose(2, 3)  # same values
    kv_scale = torch.tensor([0.5, 0.25], device="cuda") if fp8 is not None else None
    elem = token_major.element_size()
    tables = layer_block_tables(blocks, layers)
    q = torch.randn(BATCH, heads, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl_cpu = torch.arange(BATCH + 1, dtype=torch.int32)
    qsl = qsl_cpu.cuda()
    kv_bytes = sum(min(n, window or n) for n in lens) * kv_heads * HEAD_DIM * 2 * elem * layers
    outs = [torch.empty_like(q) for _ in range(layers)]

    def graph_ms(cache, longest_first: bool, config=None) -> float:
        plan = plan_attention(
            qsl_cpu.numpy(), seq_lens.cpu().numpy(), heads, kv_heads, HEAD_DIM, "cuda",
            decode=config, sliding_window=window, kv_element_size=elem,
        )  # fmt: skip
        if longest_first:
            plan.launches = [order_by_length(launch, seq_lens) for launch in plan.launches]

        def step():
            for layer in range(layers):
                paged_attention(
                    q, cache, tables[layer], seq_lens, qsl, HEAD_DIM**-0.5, plan=plan,
                    out=outs[layer], kv_scale=kv_scale,
                )  # fmt: skip

        return graph_median_ms(step)

    tbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e12  # noqa: E731
    config = decode_config(heads // kv_heads, HEAD_DIM, elem)
    print(f"{args.model}: {BATCH} requests, mean seq_len {sum(lens) / BATCH:.0f}, {layers} "
          f"layers, {kv_bytes / 1e9:.2f} GB of K/V per step ({args.kv_cache_dtype}), "
          f"{config}")  # fmt: skip
    variants = {
        (layout, order): (cache, order == "longest first")
        for layout, cache in (("token-major", token_major), ("head-major", head_major))
        for order in ("request order", "longest first")
    }
    if fp8 is not None:  # both layouts, longest first; tiles read as int16 pairs + PTX or .to()
        variants = {v: c for v, c in variants.items() if v[1] == "longest first"}
    conversions = (True, False) if fp8 is not None else (True,)
    times = {(*v, c): [] for v in variants for c in conversions}
    for _ in range(3):
        for v, (cache, longest) in variants.items():
            for conversion in conversions:
                fp8_convert.ENABLED = conversion
                times[(*v, conversion)].append(graph_ms(cache, longest))
    fp8_convert.ENABLED = True
    for (layout, order, conversion), ts in times.items():
        ms = statistics.median(ts)
        per_layer_us = ms * 1e3 / layers
        how = "" if fp8 is None else (" int16 pairs" if conversion else " fp8 .to() ")
        print(f"  {layout:11s} {order:13s}{how}: {per_layer_us:6.1f} us a layer, "
              f"{tbps(ms):.2f} TB/s")  # fmt: skip

    if args.sweep or args.tiles:
        base = decode_config(heads // kv_heads, HEAD_DIM, elem)
        results = []
        tiles = [tuple(map(int, t.split("/"))) for t in args.tiles.split(",") if t] or list(
            itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4))
        )
        for block_n, warps, stages in tiles:
            if args.quick_sweep and (warps not in (2, 4) or block_n == 16 or stages == 4):
                continue
            config = replace(base, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = graph_ms(token_major, True, config)
            except Exception as e:  # out of shared memory, ...
                print(f"  sweep {block_n}/{warps}/{stages}: {type(e).__name__}")
                continue
            key = (config, (torch.bfloat16, token_major.dtype), HEAD_DIM, block_size)
            used = _STAGES_THAT_FIT.get(key)
            if used != stages:  # out of shared memory: the kernel fell back to fewer stages
                print(f"  sweep {block_n}/{warps}/{stages}: does not fit (ran with {used})")
                continue
            results.append((ms, block_n, warps, stages))
            print(f"  sweep block_n={block_n} warps={warps} stages={stages}: {tbps(ms):.2f} TB/s")
        for ms, block_n, warps, stages in sorted(results)[:5]:
            print(f"  best: block_n={block_n} warps={warps} stages={stages}: {tbps(ms):.2f} TB/s")


if __name__ == "__main__":
    main()
