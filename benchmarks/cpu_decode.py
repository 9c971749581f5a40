"""CPU decode attention per step: the in-place C++ kernel vs gather + SDPA (torch backend).

    python benchmarks/cpu_decode.py                          # SmolLM2-135M shape, 48 decodes
    python benchmarks/cpu_decode.py --dtype bfloat16 --kv-cache-dtype fp8
    python benchmarks/cpu_decode.py --batch 4 --context 32 --rounds 2   # a smoke run

A decode-only step of `--batch` requests with `--context` cached tokens each (+-50%, random),
their blocks shuffled over the cache; every round times `--layers` calls of
`TorchAttentionBackend.forward` (metadata built once, as the runner does) on each path, A B A B.
Reports the median step time of each path in ms and their ratio. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pagellm.attention import cpu_decode
from pagellm.attention.base import CommonAttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kv_cache_dtype import kv_cache_torch_dtype


def decode_step(batch: int, context: int, block_size: int, seed: int) -> CommonAttentionMetadata:
    """A decode-only step: one new token per request, blocks in random order."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(context // 2, context * 3 // 2 + 1, batch).astype(np.int32) + 1
    blocks = -(-seq_lens // block_size)
    ids = rng.permutation(int(blocks.sum())).astype(np.int32)
    table = np.zeros((batch, int(blocks.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(blocks)])
    for r in range(batch):
        table[r, : blocks[r]] = ids[starts[r] : starts[r + 1]]
    last = seq_lens - 1
    slots = table[np.arange(batch), last // block_size].astype(np.int64) * block_size
    qsl = np.arange(batch + 1, dtype=np.int32)
    return CommonAttentionMetadata(
        num_reqs=batch, block_size=block_size, num_actual_tokens=batch, max_query_len=1,
        max_seq_len=int(seq_lens.max()), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots + last % block_size),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )  # fmt: skip


def time_step(backend, inputs, cache, common, layers: int, in_place: bool) -> float:
    """Seconds for `layers` forwards of one decode step on one path."""
    TorchAttentionBackend.in_place = in_place
    metadata = TorchAttentionBackend.build_metadata(common)
    start = time.perf_counter()
    for _ in range(layers):
        backend.forward(*inputs, cache, metadata)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    if cpu_decode.kernel() is None:
        raise SystemExit("the CPU decode kernel is not available here (no C++ compiler?)")
    dtype = getattr(torch, args.dtype)
    common = decode_step(args.batch, args.context, args.block_size, seed=0)
    num_blocks = int(common.block_table.max()) + 1
    shape = TorchAttentionBackend.kv_cache_shape(
        num_blocks, args.block_size, args.kv_heads, args.head_dim
    )
    cache = torch.randn(shape).to(kv_cache_torch_dtype(args.kv_cache_dtype, dtype))
    q = torch.randn(args.batch, args.heads, args.head_dim, dtype=dtype)
    k, v = (torch.randn(args.batch, args.kv_heads, args.head_dim, dtype=dtype) for _ in "kv")
    backend = TorchAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds + 1):  # the first round warms up
        for path in (True, False):
            times[path].append(time_step(backend, (q, k, v), cache, common, args.layers, path))
    in_place, gather = (statistics.median(times[x][1:]) * 1e3 for x in (True, False))
    print(f"decode step attention ({args.layers} layers): in place {in_place:.2f} ms, "
          f"gather + SDPA {gather:.2f} ms")  # fmt: skip
    result = {**vars(args), "threads": torch.get_num_threads(),
              "in_place_ms": round(in_place, 3), "gather_sdpa_ms": round(gather, 3),
              "speedup": round(gather / in_place, 3)}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
