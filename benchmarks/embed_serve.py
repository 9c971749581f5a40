"""Embedding requests through the server: `pagellm serve` against `vllm serve`, alternated.

Issue 41's GPU workload: an embedding model at bge-large's shape (`--shape bge-large`: a
BertModel of 24 layers, hidden 1024, mean pooling, normalized) or Qwen3-Embedding-0.6B's
(`qwen3-embedding-0.6b`: a Qwen3Model of 28 layers, hidden 1024, 16 / 8 heads, last-token
pooling, normalized), random weights (seeded) and a WordPiece tokenizer over a word list,
saved with sentence-transformers' files; `--num-prompts` requests of `--input-len` random
token ids (within the tokenizer's vocabulary) posted to `/v1/embeddings` by `--concurrency`
clients (`pagellm bench serve --backend openai-embeddings`, in-process). Both servers start
first on their own ports (each `--gpu-memory-utilization`; encoders keep no KV cache) and only
one takes load at a time: rounds go A B A B. requests/s each round, the ratio of the medians.

    python benchmarks/embed_serve.py --shape bge-large --peer vllm      # on a GPU
    python benchmarks/embed_serve.py --shape tiny --device cpu          # smoke run, no peer

`--peer vllm` runs `python -m vllm.entrypoints.openai.api_server` with `--peer-python`
(default this interpreter; vLLM importable there, e.g. PYTHONPATH=/root/anchor/site). The last
line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as a script, this folder leads sys.path: a script named like a package would shadow it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

QWEN3_EMBEDDING_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151669, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


from pagellm.benchmarks.scripts import load_script  # noqa: E402 (after the path is set)

# this folder's pooling.py (BERT shapes, the folder it saves, its word list), by path
pooling = load_script(_HERE / "pooling.py", "pooling_bench")


def save_model(folder: Path, shape: str) -> str:
    """The shape's model with random weights and ST's files (see the module doc)."""
    import torch

    if shape in pooling.SHAPES:
        return pooling.save_model(folder, shape)
    from transformers import AutoModel, Qwen3Config

    pooling.save_model(folder, "tiny")  # the tokenizer and ST files, then the Qwen3 weights
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    config = Qwen3Config(architectures=["Qwen3Model"], pad_token_id=0, **QWEN3_EMBEDDING_06B)
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.bfloat16).save_pretrained(str(folder))
    pool = {"word_embedding_dimension": config.hidden_size, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    return str(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, cmd: list[str], log_dir: str, env: dict) -> tuple[subprocess.Popen, str]:
    log = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115 (the server's life)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log.name


def wait_healthy(url: str, proc: subprocess.Popen, log: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited:\n{Path(log).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy in {timeout} s:\n{Path(log).read_text()[-3000:]}")


def server_commands(args, folder: str) -> dict[str, tuple[list[str], dict]]:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    gpu = []
    if args.device == "cuda":
        gpu = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    path = os.pathsep.join([str(_HERE.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    ours = [sys.executable, "-m", "pagellm", "serve", folder, "--device", args.device]
    ours += common + gpu
    commands = {"pagellm": (ours, env)}
    if args.peer == "vllm":
        peer = [args.peer_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", folder, "--runner", "pooling", *common, *gpu]  # fmt: skip
        commands["vllm"] = (peer, {**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    return commands


def one_round(url: str, args, vocab: int) -> dict:
    import asyncio

    from pagellm.benchmarks import serve

    ns = argparse.Namespace(
        url=url, backend="openai-embeddings", model=None, num_prompts=args.num_prompts,
        concurrency=args.concurrency, input_len=args.input_len, output_len=0,
        token_range=[5, vocab], api_key=None, seed=args.seed,
    )  # fmt: skip
    return asyncio.run(serve.benchmark(ns))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp) / args.shape, args.shape)
        vocab = len((Path(folder) / "vocab.txt").read_text().split())
        servers = {}
        try:
            for name, (cmd, env) in server_commands(args, folder).items():
                port = _free_port()
                proc, log = start(name, [*cmd, "--port", str(port)], tmp, env)
                servers[name] = (f"http://127.0.0.1:{port}", proc, log)
            for url, proc, log in servers.values():
                wait_healthy(url, proc, log, args.start_timeout)
            rounds: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, (url, _, _) in servers.items():
                    result = one_round(url, args, vocab)
                    rounds[name].append(result)
                    print(f"{name:8s} {result['request_throughput']:9.2f} req/s  "
                          f"E2EL p50 {result['e2el_ms_p50']} ms  failed {result['failed']}",
                          flush=True)  # fmt: skip
        finally:
            for _, proc, _ in servers.values():
                proc.terminate()
            for _, proc, _ in servers.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rates = {n: [r["request_throughput"] for r in rs] for n, rs in rounds.items()}
    summary = {
        "shape": args.shape, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "input_len": args.input_len, "requests_per_s": rates,
        "failed": {n: sum(r["failed"] for r in rs) for n, rs in rounds.items()},
        "e2el_ms_p50": {n: [r["e2el_ms_p50"] for r in rs] for n, rs in rounds.items()},
    }  # fmt: skip
    if "vllm" in rates:
        ratio = statistics.median(rates["pagellm"]) / statistics.median(rates["vllm"])
        summary["ratio"] = round(ratio, 3)
    print(json.dumps(summary))
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="bge-large",
                   choices=[*pooling.SHAPES, "qwen3-embedding-0.6b"])  # fmt: skip
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--peer", default="none", choices=["none", "vllm"])
    p.add_argument("--peer-python", default=None, help="the interpreter that imports vllm")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
