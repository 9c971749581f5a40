"""Benchmark the Triton attention kernels against torch SDPA on one CUDA GPU.

    python benchmarks/attention_kernels.py                  # decode + prefill, default shapes
    python benchmarks/attention_kernels.py --sweep decode   # also try tile/warp/stage/split configs
    python benchmarks/attention_kernels.py --sweep all
    python benchmarks/attention_kernels.py --only prompts --sweep prefill   # short prompts, varlen
    python benchmarks/attention_kernels.py --sliding-window 1024 --soft-cap 50   # a windowed layer
    python benchmarks/attention_kernels.py --kv-cache-dtype fp8                  # an fp8 KV cache

decode:  batch 64, context 4096, 32 query / 8 KV heads, head_dim 128, block 16, bf16;
         reported as TB/s of K/V read (2 * batch * seq_len * kv_heads * head_dim * 2 bytes).
prefill: one 8192-token causal prompt, 32 heads, head_dim 128, bf16, no cached prefix;
         reported as TFLOP/s (4 * heads * head_dim * S * (S + 1) / 2).
prompts: the prefill of a step of the standard workload: --prompts prompts of
         randint(100, 1024) tokens (random.seed(0)), 16 query / 8 KV heads (Qwen3-0.6B),
         in one varlen launch; against torch's varlen flash attention where it exists
         (torch.nn.attention.varlen) and SDPA run prompt by prompt.
--sliding-window W: each query reads only its last W keys (bandwidth and FLOPs count only
those, so the SDPA columns, which attend to every key, are not comparable then);
--soft-cap c: Gemma 2's logit soft-cap.
--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2: the paged cache is float8 (scales 0.5 / 0.25),
dequantized in the kernel; the decode's TB/s count fp8 bytes (1 per element); SDPA stays bf16.
SDPA runs on contiguous tensors with the flash and cuDNN backends. Times are medians of
`triton.testing.do_bench` (warm-up and compilation excluded). The last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, replace

import torch

# dense bf16 TFLOP/s and HBM TB/s, for the "of peak" columns
CEILINGS = {"H200": (989.0, 4.8), "H100": (989.0, 3.35), "A100": (312.0, 2.0)}


def ceilings() -> tuple[float, float] | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in CEILINGS.items() if k in name), None)


def paged_inputs(batch, q_len, seq_len, heads, kv_heads, head_dim, block_size, dtype):
    """Random q and a fully written paged cache with a shuffled block table."""
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(
        2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda"
    ).to(LAYER["kv_cache_dtype"] or dtype)  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_table = block_table.view(batch, blocks_per_seq)  # [batch, blocks_per_seq]
    q = torch.randn(batch * q_len, heads, head_dim, dtype=dtype, device="cuda")
    qsl_cpu = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    seq_lens_cpu = torch.full((batch,), seq_len, dtype=torch.int32)
    return q, kv_cache, block_table, qsl_cpu, seq_lens_cpu


# the layer options of every run (main() sets them from --sliding-window / --soft-cap)
LAYER = {"sliding_window": None, "logits_soft_cap": None, "kv_cache_dtype": None}


def kv_scale() -> torch.Tensor | None:
    """[k_scale, v_scale] of an fp8 cache, None for bf16."""
    if LAYER["kv_cache_dtype"] is None:
        return None
    return torch.tensor([0.5, 0.25], device="cuda")


def keys_read(q_len: int, seq_len: int) -> int:
    """Keys the queries of one request read together (each its last sliding_window)."""
    window = LAYER["sliding_window"]
    return seq_len if window is None else min(seq_len, window + q_len - 1)


def attended_pairs(q_len: int, seq_len: int) -> int:
    """(query, key) pairs of one causal request: sum over queries of the keys each sees."""
    window = LAYER["sliding_window"] or seq_len
    return sum(min(p + 1, window) for p in range(seq_len - q_len, seq_len))


def triton_fn(inputs, scale, **plan_kwargs):
    from pagellm.kernels.attention_plan import plan_attention
    from pagellm.kernels.paged_attention import paged_attention

    q, kv_cache, block_table, qsl_cpu, seq_lens_cpu = inputs
    plan = plan_attention(
        qsl_cpu.numpy(), seq_lens_cpu.numpy(), q.shape[1], kv_cache.shape[3], q.shape[2],
        q.device, sliding_window=LAYER["sliding_window"],
        kv_element_size=kv_cache.element_size(), **plan_kwargs,
    )  # fmt: skip
    qsl, seq_lens = qsl_cpu.cuda(), seq_lens_cpu.cuda()
    out = torch.empty_like(q)
    cap, scales = LAYER["logits_soft_cap"], kv_scale()
    return plan, lambda: paged_attention(
        q, kv_cache, block_table, seq_lens, qsl, scale, plan=plan, out=out,
        logits_soft_cap=cap, kv_scale=scales,
    )  # fmt: skip


def fits(cfg, head_dim: int, block_size: int) -> bool:
    """False (and says so) when the kernel fell back to fewer stages than cfg asks for."""
    from pagellm.kernels import paged_attention as pa

    used = pa._STAGES_THAT_FIT.get((cfg, torch.bfloat16, head_dim, block_size))
    if used != cfg.num_stages:
        print(f"  sweep {cfg}: does not fit in shared memory (ran with {used} stages)")
    return used == cfg.num_stages


def sdpa_times(q, k, v, causal: bool) -> dict[str, float | None]:
    """Median ms of SDPA per backend; None where the backend refuses these inputs.

    GQA runs natively (`enable_gqa`) where the backend allows it, else on K/V expanded to
    every query head beforehand (the bandwidth figures still count the unexpanded bytes).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]
    variants = [(k, v, group > 1)]
    if group > 1:
        variants.append((k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False))
    times: dict[str, float | None] = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        times[name] = None
        for kk, vv, gqa in variants:
            try:
                with sdpa_kernel(backend):
                    times[name] = do_bench(
                        lambda kk=kk, vv=vv, gqa=gqa: sdpa(
                            q, kk, vv, is_causal=causal, enable_gqa=gqa
                        ),
                        return_mode="median",
                    )
                if group > 1:
                    print(f"  sdpa {name}: GQA {'native' if gqa else 'on expanded K/V'}")
                break
            except RuntimeError as e:
                print(
                    f"  sdpa {name} (enable_gqa={gqa}): unavailable ({str(e).splitlines()[0][:80]})"
                )
    return times


def bench_decode(args, sweep: bool) -> dict:
    from triton.testing import do_bench

    from pagellm.kernels.attention_plan import decode_config

    b, s, h, kvh, d = args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim
    inputs = paged_inputs(b, 1, s, h, kvh, d, args.block_size, torch.bfloat16)
    kv_bytes = 2 * b * keys_read(1, s) * kvh * d * inputs[1].element_size()
    scale = d**-0.5
    tbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e12  # noqa: E731

    plan, fn = triton_fn(inputs, scale)
    ms = do_bench(fn, return_mode="median")
    (launch,) = plan.launches
    print(f"decode  b={b} ctx={s} heads={h}/{kvh} d={d} block={args.block_size}: "
          f"triton {ms * 1e3:.1f} us  {tbps(ms):.2f} TB/s  (splits={launch.num_splits}, "
          f"{launch.config})")  # fmt: skip

    # SDPA on contiguous K/V: [b, heads, 1, d] x [b, kv_heads, s, d]
    q = inputs[0].view(b, 1, h, d).transpose(1, 2)
    k = torch.randn(b, kvh, s, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sdpa = sdpa_times(q, k, v, causal=False)
    for name, t in sdpa.items():
        if t is not None:
            print(f"  sdpa {name}: {t * 1e3:.1f} us  {tbps(t):.2f} TB/s")
    del k, v

    best = None
    if sweep:
        base = decode_config(h // kvh, d)
        results = []
        for block_n, warps, stages, splits in itertools.product(
            (32, 64, 128), (2, 4, 8), (2, 3, 4), (None, 2)
        ):
            cfg = replace(base, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                _, f = triton_fn(inputs, scale, decode=cfg, num_splits=splits)
                t = do_bench(f, return_mode="median")
            except Exception as e:
                print(f"  sweep {cfg} splits={splits}: failed ({type(e).__name__})")
                continue
            if not fits(cfg, d, args.block_size):
                continue
            results.append((t, cfg, splits))
            print(f"  sweep block_n={block_n} warps={warps} stages={stages} splits={splits}: "
                  f"{tbps(t):.2f} TB/s")  # fmt: skip
        t, cfg, splits = min(results, key=lambda r: r[0])
        best = {"config": asdict(cfg), "num_splits": splits, "tb_per_s": tbps(t)}
        print(f"  best: {best}")
    return {
        "triton_tb_per_s": tbps(ms),
        "triton_us": ms * 1e3,
        "num_splits": launch.num_splits,
        **{f"sdpa_{k}_tb_per_s": (tbps(t) if t else None) for k, t in sdpa.items()},
        "best_sweep": best,
    }


def sweep_prefill(inputs, scale, base, block_ms, tflops, args) -> dict:
    """Prefill tiles (block_m x block_n, warps, stages) on these inputs; the fastest."""
    from triton.testing import do_bench

    results = []
    for block_m, block_n, warps, stages in itertools.product(
        block_ms, (32, 64, 128), (4, 8), (2, 3, 4)
    ):
        heads = base.heads_per_prog
        if block_m < 16 * heads:
            continue
        cfg = replace(
            base, block_q=block_m // heads, block_n=block_n, num_warps=warps, num_stages=stages
        )
        try:
            _, f = triton_fn(inputs, scale, prefill=cfg)
            t = do_bench(f, return_mode="median")
        except Exception as e:
            print(f"  sweep {cfg}: failed ({type(e).__name__})")
            continue
        if not fits(cfg, args.head_dim, args.block_size):
            continue
        results.append((t, cfg))
        print(f"  sweep block_m={block_m} block_n={block_n} warps={warps} stages={stages}: "
              f"{tflops(t):.0f} TFLOP/s")  # fmt: skip
    t, cfg = min(results, key=lambda r: r[0])
    best = {"config": asdict(cfg), "tflop_per_s": tflops(t)}
    print(f"  best: {best}")
    return best


def bench_prefill(args, sweep: bool) -> dict:
    from triton.testing import do_bench

    from pagellm.kernels.attention_plan import prefill_config

    s, h, d = args.prefill_len, args.prefill_heads, args.head_dim
    kvh = args.prefill_kv_heads or h
    inputs = paged_inputs(1, s, s, h, kvh, d, args.block_size, torch.bfloat16)
    flops = 4 * h * d * attended_pairs(s, s)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    scale = d**-0.5

    plan, fn = triton_fn(inputs, scale)
    ms = do_bench(fn, return_mode="median")
    cfg = plan.launches[0].config
    print(f"prefill S={s} heads={h}/{kvh} d={d} block={args.block_size}: "
          f"triton {ms:.3f} ms  {tflops(ms):.0f} TFLOP/s  ({cfg})")  # fmt: skip

    from pagellm.kernels.reshape_and_cache import reshape_and_cache

    kv_cache = inputs[1]
    key = torch.randn(s, kvh, d, dtype=torch.bfloat16, device="cuda")  # [S, kv_heads, d]
    slots = torch.randperm(kv_cache.shape[1] * args.block_size, device="cuda")[:s]
    scales = kv_scale()
    write = lambda: reshape_and_cache(key, key, kv_cache, slots, scales)  # noqa: E731
    write_ms = do_bench(write, return_mode="median")
    write_gbps = 2 * 2 * key.numel() * 2 / (write_ms * 1e-3) / 1e9  # read + write, K and V
    print(f"reshape_and_cache {s} tokens: {write_ms * 1e3:.1f} us  {write_gbps:.0f} GB/s")

    q = inputs[0].view(1, s, h, d).transpose(1, 2)  # [1, heads, S, d]
    k = torch.randn(1, kvh, s, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sdpa = sdpa_times(q, k, v, causal=True)
    for name, t in sdpa.items():
        if t is not None:
            print(f"  sdpa {name}: {t:.3f} ms  {tflops(t):.0f} TFLOP/s")

    best = (
        sweep_prefill(inputs, scale, prefill_config(h // kvh, d), (64, 128), tflops, args)
        if sweep
        else None
    )
    return {
        "triton_tflop_per_s": tflops(ms),
        "triton_ms": ms,
        "reshape_and_cache_gb_per_s": write_gbps,
        **{f"sdpa_{k}_tflop_per_s": (tflops(t) if t else None) for k, t in sdpa.items()},
        "best_sweep": best,
    }


def bench_prompts(args, sweep: bool) -> dict:
    """Many short causal prompts, no cached prefix: one varlen launch."""
    import random

    from triton.testing import do_bench

    from pagellm.kernels.attention_plan import prefill_config

    rng = random.Random(0)
    lens = [rng.randint(100, 1024) for _ in range(args.prompts)]
    h, kvh, d, bs = args.prompt_heads, args.prompt_kv_heads, args.head_dim, args.block_size
    total = sum(lens)
    blocks = [-(-n // bs) for n in lens]
    kv_cache = torch.randn(2, sum(blocks), bs, kvh, d, dtype=torch.bfloat16, device="cuda")
    kv_cache = kv_cache.to(LAYER["kv_cache_dtype"] or torch.bfloat16)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    perm, start = torch.randperm(sum(blocks), dtype=torch.int32), 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[start : start + nb]
        start += nb
    q = torch.randn(total, h, d, dtype=torch.bfloat16, device="cuda")
    qsl_cpu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    inputs = (q, kv_cache, table.cuda(), qsl_cpu, torch.tensor(lens, dtype=torch.int32))
    flops = sum(4 * h * d * attended_pairs(n, n) for n in lens)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    scale = d**-0.5
    plan, fn = triton_fn(inputs, scale)
    ms = do_bench(fn, return_mode="median")
    print(f"prompts: {len(lens)} of {min(lens)}-{max(lens)} tokens ({total}), heads {h}/{kvh}: "
          f"triton {ms:.3f} ms {tflops(ms):.0f} TFLOP/s ({plan.launches[-1].config})")  # fmt: skip

    # the same attention from contiguous K/V: varlen flash (one call), SDPA per prompt
    k = torch.randn(total, kvh, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    others: dict[str, float | None] = {"varlen_flash": None, "sdpa_per_prompt": None}
    try:
        from torch.nn.attention.varlen import varlen_attn

        cu = qsl_cpu.cuda()
        n_max = max(lens)
        try:  # later torch: window_size=(-1, 0) is causal; 2.10: is_causal
            call = lambda: varlen_attn(q, k, v, cu, cu, n_max, n_max, window_size=(-1, 0))  # noqa: E731
            call()
        except TypeError:
            call = lambda: varlen_attn(q, k, v, cu, cu, n_max, n_max, is_causal=True)  # noqa: E731
        others["varlen_flash"] = do_bench(call, return_mode="median")
    except Exception as e:  # not in this torch, or it refuses GQA
        print(f"  varlen flash: unavailable ({type(e).__name__}: {e})")
    views = [
        (q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None])
        for a, b in itertools.pairwise(qsl_cpu.tolist())
    ]

    def per_prompt():
        for qq, kk, vv in views:
            torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, enable_gqa=True
            )

    others["sdpa_per_prompt"] = do_bench(per_prompt, return_mode="median")
    for name, t in others.items():
        if t is not None:
            print(f"  {name}: {t:.3f} ms  {tflops(t):.0f} TFLOP/s")

    base = prefill_config(h // kvh, d)
    best = sweep_prefill(inputs, scale, base, (32, 64, 128), tflops, args) if sweep else None
    return {
        "triton_tflop_per_s": tflops(ms),
        **{f"{k}_tflop_per_s": (tflops(t) if t else None) for k, t in others.items()},
        "best_sweep": best,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--prefill-heads", type=int, default=32)
    p.add_argument("--prefill-kv-heads", type=int, default=0, help="0: same as heads (MHA)")
    p.add_argument("--prompts", type=int, default=14, help="prompts of the 'prompts' case")
    p.add_argument("--prompt-heads", type=int, default=16)
    p.add_argument("--prompt-kv-heads", type=int, default=8)
    p.add_argument("--only", choices=("decode", "prefill", "prompts"), default=None)
    p.add_argument("--sweep", choices=("decode", "prefill", "all"), default=None)
    p.add_argument("--sliding-window", type=int, default=0, help="0: none")
    p.add_argument("--soft-cap", type=float, default=0.0, help="logit soft-cap; 0: none")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | fp8_e5m2")
    args = p.parse_args()
    LAYER.update(sliding_window=args.sliding_window or None, logits_soft_cap=args.soft_cap or None)
    if args.kv_cache_dtype != "auto":
        from pagellm.kv_cache_dtype import kv_cache_torch_dtype

        LAYER["kv_cache_dtype"] = kv_cache_torch_dtype(args.kv_cache_dtype, torch.bfloat16)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_kernels.py needs a CUDA GPU (Triton kernels); none found.")
    torch.manual_seed(0)

    result: dict = {"device": torch.cuda.get_device_name(), **LAYER}
    result["kv_cache_dtype"] = args.kv_cache_dtype
    if args.only in (None, "decode"):
        result["decode"] = bench_decode(args, sweep=args.sweep in ("decode", "all"))
    if args.only in (None, "prefill"):
        result["prefill"] = bench_prefill(args, sweep=args.sweep in ("prefill", "all"))
    if args.only == "prompts":
        result["prompts"] = bench_prompts(args, sweep=args.sweep in ("prefill", "all"))
    if (ceil := ceilings()) is not None:
        peak_tflops, peak_tbps = ceil
        if "decode" in result:
            result["decode"]["of_peak_bw"] = result["decode"]["triton_tb_per_s"] / peak_tbps
        if "prefill" in result:
            result["prefill"]["of_peak_flops"] = (
                result["prefill"]["triton_tflop_per_s"] / peak_tflops
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
