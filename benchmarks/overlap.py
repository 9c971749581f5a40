"""What NanoFlow-style nano-batches would buy a decode step: one batch's layers run whole,
against the batch split in two halves whose chains run on two CUDA streams, so one half's
attention (memory-bound) can run beside the other half's GEMMs (compute-bound).

    python benchmarks/overlap.py                  # Qwen3-0.6B shape, the standard workload
    python benchmarks/overlap.py --model llama    # Llama-3.1-8B shape
    python benchmarks/overlap.py --batch 512 --fixed 768   # fixed 512: every seq_len 768

Each layer is the decode step's big kernels: the QKV projection, paged attention (our Triton
kernel over a paged bf16 cache, every layer its own pages), the output projection, gate/up
and down (cuBLAS through `F.linear`, bf16); norms, rotary and the activation are left out,
so the figures bound what overlap can buy (those small kernels overlap too). All layers of
one step are captured in one CUDA graph, as the engine's decode graphs are. Variants, timed
in turns (A B C D, five times), medians:

- whole: the batch through every layer, one stream (today's engine);
- halves, one stream: the two halves one after the other (the cost of splitting alone:
  GEMMs at half M, two attention launches);
- halves, two streams: each half's chain on its own stream (graph branches: the GPU runs
  them side by side where SMs and bandwidth allow);
- halves, two streams, staggered: the second half starts once the first half's first QKV
  projection is done, so its GEMMs meet the first half's attention;
- with `--gemm-sm-carveout N ...`: halves on two streams with cuBLASLt told to leave N SMs
  free (`torch._C._set_sm_carveout_experimental`), so attention CTAs find SMs to run on
  beside the GEMMs; the GEMMs alone under the same carveout are timed too.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import graph_median_ms, layer_block_tables  # noqa: E402

# hidden, intermediate, heads, kv heads, head_dim, layers
SHAPES = {"qwen": (1024, 3072, 16, 8, 128, 28), "llama": (4096, 14336, 32, 8, 128, 32)}
BLOCK_SIZE = 16


def main() -> None:
    from pagellm.kernels.attention_plan import plan_attention
    from pagellm.kernels.paged_attention import paged_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--fixed", type=int, default=0, help="every seq_len this (0: standard's)")
    p.add_argument("--gemm-sm-carveout", type=int, nargs="*", default=[])
    args = p.parse_args()
    hidden, inter, heads, kv_heads, head_dim, layers = SHAPES[args.model]
    batch = args.batch
    rng = random.Random(0)
    lens = [args.fixed or rng.randint(100, 1024) + 256 for _ in range(batch)]
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=bf16) * 0.02

    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    per_layer = sum(blocks)
    cache = rand(2, per_layer * layers, BLOCK_SIZE, kv_heads, head_dim)
    tables = layer_block_tables(blocks, layers)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    weights = [
        (rand(q_size + 2 * kv_size, hidden), rand(hidden, q_size),
         rand(2 * inter, hidden), rand(hidden, inter))
        for _ in range(layers)
    ]  # fmt: skip
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    x0 = rand(batch, hidden)

    class Part:
        """A slice of the batch's requests with its own attention plan and buffers."""

        def __init__(self, lo: int, hi: int) -> None:
            n = hi - lo
            qsl = torch.arange(n + 1, dtype=torch.int32)
            self.seq_lens = seq_lens[lo:hi]
            self.tables = [t[lo:hi] for t in tables]
            self.qsl = qsl.to(dev)
            self.plan = plan_attention(
                qsl.numpy(), self.seq_lens.cpu().numpy(), heads, kv_heads, head_dim, dev
            )
            self.x0 = x0[lo:hi].clone()  # every step starts from it
            self.x = self.x0
            self.out = torch.empty(n, heads, head_dim, device=dev, dtype=bf16)

        def layer(self, i: int, after_qkv: torch.cuda.Event | None = None,
                  attention: bool = True, gemms: bool = True) -> None:  # fmt: skip
            w_qkv, w_o, w_gate_up, w_down = weights[i]
            if i == 0:
                self.x = self.x0
            if not gemms:  # attention alone, on a query of the right shape
                self.attend(i, self.out)
                return
            qkv = F.linear(self.x, w_qkv)
            if after_qkv is not None:
                after_qkv.record()
            if attention:
                self.attend(i, qkv[:, :q_size].view(-1, heads, head_dim))
            h = self.x + F.linear(self.out.view(-1, q_size), w_o)
            gate_up = F.linear(h, w_gate_up)
            self.x = h + F.linear(gate_up[:, :inter] * gate_up[:, inter:], w_down)

        def attend(self, i: int, q: torch.Tensor) -> None:
            paged_attention(q, cache, self.tables[i], self.seq_lens, self.qsl, head_dim**-0.5,
                            plan=self.plan, out=self.out)  # fmt: skip

    whole, first, second = Part(0, batch), Part(0, batch // 2), Part(batch // 2, batch)
    side = torch.cuda.Stream()

    def run_whole() -> None:
        for i in range(layers):
            whole.layer(i)

    def run_halves_serial() -> None:
        for i in range(layers):
            first.layer(i)
            second.layer(i)

    def run_halves_streams(stagger: bool) -> None:
        main = torch.cuda.current_stream()
        started = torch.cuda.Event() if stagger else None
        side.wait_stream(main)
        for i in range(layers):
            first.layer(i, started if i == 0 else None)
        with torch.cuda.stream(side):
            if started is not None:
                side.wait_event(started)
            for i in range(layers):
                second.layer(i)
        main.wait_stream(side)

    variants = {
        "whole batch, one stream": run_whole,
        "halves, one stream": run_halves_serial,
        "halves, two streams": lambda: run_halves_streams(False),
        "halves, two streams, staggered": lambda: run_halves_streams(True),
    }
    carveouts = {f"halves, two streams, GEMMs leave {n} SMs": n for n in args.gemm_sm_carveout}
    if carveouts:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # where the carveout applies
        variants |= {name: lambda: run_halves_streams(False) for name in carveouts}

    def timed(name, fn) -> float:
        torch._C._set_sm_carveout_experimental(carveouts.get(name))
        try:
            return graph_median_ms(fn)  # the carveout is captured with the GEMM launches
        finally:
            torch._C._set_sm_carveout_experimental(None)

    times = {name: [] for name in variants}
    for _ in range(5):
        for name, fn in variants.items():
            times[name].append(timed(name, fn))
    mean_len = sum(lens) / batch
    print(f"{args.model}: {batch} requests, mean seq_len {mean_len:.0f}, {layers} layers, "
          f"GEMMs + paged attention only, bf16, CUDA graphs")  # fmt: skip
    base = statistics.median(times["whole batch, one stream"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:40s} {ms:7.3f} ms a step  ({base / ms:.3f}x the whole batch)")
    alone = {}
    for what, kw in (("attention", dict(gemms=False)), ("GEMMs", dict(attention=False))):
        alone[what] = graph_median_ms(lambda kw=kw: [whole.layer(i, **kw) for i in range(layers)])
        print(f"  {what + ' alone, whole batch':40s} {alone[what]:7.3f} ms")
    for name, n in carveouts.items():
        ms = timed(name, lambda: [whole.layer(i, attention=False) for i in range(layers)])
        print(f"  {f'GEMMs alone, leaving {n} SMs':40s} {ms:7.3f} ms")
    bound = max(alone.values())
    print(f"  perfect overlap: max of the two = {bound:.3f} ms ({base / bound:.3f}x); the sum "
          f"{sum(alone.values()):.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
