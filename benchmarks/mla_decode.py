"""The latent-attention (MLA) decode kernel (`pagellm/kernels/mla_decode.py`) against its
bandwidth bound and against torch's absorbed attention over gathered rows (CUDA).

    python benchmarks/mla_decode.py                       # V2-Lite and V3 heads, 1 .. 128 rows
    python benchmarks/mla_decode.py --context 16384 --hbm-tb-s 4.8   # an H200
    TRITON_INTERPRET=1 python benchmarks/mla_decode.py --tiny        # CPU: the path, checked only

A decode step's attention of one layer: `batch` requests of `context` cached tokens, each
token one latent row of R + P = 512 + 64 bf16 numbers (DeepSeek-V2-Lite's and V3's), heads
16 (V2-Lite) or 128 (V3), block size 16, the block table shuffled. Per (heads, batch):

- `kernel_us`: `mla_decode` (split-KV as the wrapper chooses) replayed in a CUDA graph
  (`triton.testing.do_bench_cudagraph`), as the engine's decode steps run it: timed eagerly,
  a call below ~128 requests measured its wrapper's launches (~330 us on an H100, 2026-12-07),
  not the kernel;
- `torch_us` (the first tile's rows only): the same attention as torch would do it (rows
  gathered, one batched matmul for the scores, softmax, one for the output);
- `tb_s`: the latent rows the kernel must read (batch x context x 576 x 2 bytes) per second,
  and `of_bound`: that as a fraction of HBM bandwidth (`--hbm-tb-s`, default 3.35: H100
  SXM), the issue's goal being >= 0.70.

`--block-h 16 32 64` times each heads-a-program tile (`--num-warps` each): a program reads
its request's latent rows once, so 128 heads in tiles of 16 read every row 8 times.

Each configuration is first checked against the torch result. The last line is one JSON
object. `--tiny` runs tiny shapes on the CPU under Triton's interpreter: no speed claims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

RANK, ROPE, BLOCK = 512, 64, 16
HEADS = (16, 128)
BATCHES = (1, 8, 32, 128)


def inputs(batch: int, heads: int, context: int, rank: int, rope: int, device: str):
    """Absorbed queries, a full latent cache in shuffled blocks, its table and lengths."""
    blocks = -(-context // BLOCK)
    cache = torch.randn(1, batch * blocks, BLOCK, 1, rank + rope, device=device)
    table = torch.randperm(batch * blocks, device=device, dtype=torch.int32).view(batch, blocks)
    q = torch.randn(batch, heads, rank + rope, device=device) * (rank + rope) ** -0.5
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, cache, table, seq_lens


def torch_decode(q, cache, table, context: int, rank: int, scale: float) -> torch.Tensor:
    """softmax(scale q . rows) @ latent, rows gathered by the block table: [batch, H, R]."""
    flat = cache.view(-1, cache.shape[-1])
    pos = torch.arange(context, device=q.device)
    slots = table.long()[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [batch, context]
    rows = flat.index_select(0, slots.view(-1)).view(q.shape[0], context, -1)
    probs = torch.softmax(torch.bmm(q.float(), rows.float().transpose(1, 2)) * scale, dim=-1)
    return torch.bmm(probs, rows.float()[..., :rank])


def measure(batch: int, heads: int, context: int, dtype, rank: int, rope: int, timed: bool,
            block_h: int = 16, num_warps: int = 4, time_torch: bool = True):  # fmt: skip
    from pagellm.kernels.mla_decode import mla_decode

    device = "cuda" if timed else "cpu"
    q, cache, table, seq_lens = inputs(batch, heads, context, rank, rope, device)
    q, cache = q.to(dtype), cache.to(dtype)
    scale = 192**-0.5

    def kernel():
        return mla_decode(q, cache, table, seq_lens, rank, scale, max_seq_len=context,
                          block_h=block_h, num_warps=num_warps)  # fmt: skip

    def reference():
        return torch_decode(q, cache, table, context, rank, scale)

    err = (kernel().float() - reference()).abs().max().item()
    row = dict(heads=heads, batch=batch, context=context, block_h=block_h,
               num_warps=num_warps, max_abs_err=err)  # fmt: skip
    if not timed:
        return row
    import triton

    kernel_us = triton.testing.do_bench_cudagraph(kernel, return_mode="median") * 1e3
    torch_us = (triton.testing.do_bench_cudagraph(reference, return_mode="median") * 1e3
                if time_torch else float("nan"))  # fmt: skip
    read = batch * context * (rank + rope) * cache.element_size()
    return dict(row, kernel_us=kernel_us, torch_us=torch_us, tb_s=read / kernel_us / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--hbm-tb-s", type=float, default=3.35)
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    ap.add_argument("--block-h", type=int, nargs="+", default=[16], help="heads a program")
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4])
    args = ap.parse_args()
    tiles = [(h, w) for h in args.block_h for w in args.num_warps]
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(
                "--tiny runs the kernel under Triton's interpreter: TRITON_INTERPRET=1"
            )
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from test_kernels import _patch_interpreter_for_numpy_2_4  # the tests' interpreter fix

        _patch_interpreter_for_numpy_2_4()  # the key loop runs to a loaded length
        rows = [measure(b, h, 40, torch.float32, 32, 16, False, bh, w)
                for h in (4, 20) for b in (1, 3) for bh, w in tiles]  # fmt: skip
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --tiny with TRITON_INTERPRET=1)")
        rows = []
        for heads in HEADS:
            for batch in BATCHES:
                for i, (block_h, warps) in enumerate(tiles):
                    try:  # a tile too large for the chip's registers / shared memory
                        row = measure(batch, heads, args.context, torch.bfloat16, RANK, ROPE,
                                      True, block_h, warps, time_torch=i == 0)  # fmt: skip
                    except Exception as e:  # noqa: BLE001 (reported, the sweep goes on)
                        print(
                            f"heads {heads} batch {batch} block_h {block_h} warps {warps}: "
                            f"{type(e).__name__}: {str(e)[:200]}"
                        )
                        continue
                    row["of_bound"] = row["tb_s"] / args.hbm_tb_s
                    rows.append(row)
                    print(f"heads {heads:4d} batch {batch:4d} block_h {block_h:3d} warps "
                          f"{warps}: kernel {row['kernel_us']:8.1f} us ({row['tb_s']:.2f} TB/s, "
                          f"{row['of_bound']:.0%} of bound), torch {row['torch_us']:8.1f} us, "
                          f"max err {row['max_abs_err']:.1e}")  # fmt: skip
    for row in rows:
        assert row["max_abs_err"] < 5e-2, row
    print(json.dumps({"mla_decode": rows}))


if __name__ == "__main__":
    main()
