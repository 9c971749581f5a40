"""All-reduce latency at decode sizes: what tensor parallelism adds to each decode step.

One process per GPU (NCCL; `--device cpu`: gloo, a smoke test), torch.distributed
`all_reduce` of [rows, hidden] tensors in the model's dtype, as a decode step issues them:
eager (launch cost included) and replayed from a CUDA graph that holds `--per-graph` of
them back to back (how pagellm's decode graphs run them). A Llama layer reduces twice per
step (after o_proj and down_proj) and the embedding once, so a decode step of `rows`
requests costs about (2 * layers + 1) reduces of [rows, hidden]:

    python benchmarks/allreduce.py -tp 2 --hidden 8192 --layers 80   # Llama-3.1-70B shape
    python benchmarks/allreduce.py -tp 2 --hidden 4096 --layers 32   # Llama-3.1-8B shape

Prints microseconds per all-reduce and per decode step for each row count, then one JSON
line. Keep NCCL_NVLS_ENABLE=0 (no NVLink multicast) where the machine asks for it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--per-graph", type=int, default=32)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return ap.parse_args()


def eager_us(x: torch.Tensor, iters: int, sync) -> float:
    for _ in range(10):
        dist.all_reduce(x)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def graph_us(x: torch.Tensor, iters: int, per_graph: int) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            dist.all_reduce(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replays = max(1, iters // per_graph)
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * per_graph) * 1e6


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.tensor_parallel_size,
        device_id=device if cuda else None,
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, args.dtype)
    rows_out = {}
    for rows in args.rows:
        x = torch.ones(rows, args.hidden, dtype=dtype, device=device)
        result = {"eager_us": round(eager_us(x, args.iters, sync), 1)}
        if cuda:
            result["graph_us"] = round(graph_us(x, args.iters, args.per_graph), 1)
        per_op = result.get("graph_us", result["eager_us"])
        result["per_decode_step_us"] = round(per_op * (2 * args.layers + 1), 1)
        rows_out[rows] = result
        if rank == 0:
            print(f"rows {rows:4d}: {result}", flush=True)
    if rank == 0:
        summary = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "args": vars(args),
            "by_rows": rows_out,
        }
        print(json.dumps(summary))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tensor_parallel_size:
        raise SystemExit(f"needs {args.tensor_parallel_size} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(args, port), nprocs=args.tensor_parallel_size)


if __name__ == "__main__":
    main()
