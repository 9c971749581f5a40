"""`pagellm bench serve`: load-test a running OpenAI-compatible server.

`--concurrency` clients stream `/v1/completions` (random token-id prompts of `--input-len`,
`--output-len` tokens each with ignore_eos, greedy) until `--num-prompts` requests are done,
after one warm-up request that is not counted. Prints request throughput, output tokens/s,
time to first token (TTFT), inter-token latency (ITL: the gap between two streamed chunks) and
time per output token (TPOT), then one JSON line with the same numbers.

`--backend openai-embeddings` (vLLM's name) posts each prompt to `/v1/embeddings` instead (an
embedding model's server; no output tokens): request throughput, input tokens/s and the
end-to-end latency of a request (E2EL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

_PERCENTILES = (50, 90, 99)
_TOKEN_RANGE = (1000, 20000)  # random prompt token ids: ordinary tokens in any real vocab


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "openai-embeddings"],
        help="openai: streamed /v1/completions; openai-embeddings: /v1/embeddings",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--token-range", type=int, nargs=2, default=list(_TOKEN_RANGE),
                   metavar=("LOW", "HIGH"), help="random prompt ids in [LOW, HIGH)")  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def main(ns: argparse.Namespace) -> int:
    summary = asyncio.run(benchmark(ns))
    _print_summary(summary)
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 else 1


async def benchmark(ns: argparse.Namespace) -> dict[str, Any]:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=ns.concurrency + 1)
    async with httpx.AsyncClient(
        base_url=ns.url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = ns.model or await _first_model(client)
        rng = random.Random(ns.seed)
        prompts = [
            [rng.randrange(*ns.token_range) for _ in range(ns.input_len)]
            for _ in range(ns.num_prompts)
        ]
        request = _embed if ns.backend == "openai-embeddings" else _request
        await request(client, model, prompts[0][:8], 2)  # warm-up, not counted
        start = time.perf_counter()
        results = await _run_clients(request, client, model, prompts, ns.output_len, ns.concurrency)
        duration = time.perf_counter() - start
    return summarize(results, duration, ns)


async def _first_model(client: Any) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _run_clients(
    request, client: Any, model: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> list[RequestResult]:
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await request(client, model, queue.get_nowait(), output_len))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _request(client: Any, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            await _read_stream(response, result, start)
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


async def _embed(client: Any, model: str, prompt: list[int], _output_len: int) -> RequestResult:
    """One /v1/embeddings request of a token-id prompt; ok when a vector came back."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        response = await client.post("/v1/embeddings", json={"model": model, "input": prompt})
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return result
        data = response.json().get("data") or [{}]
        result.ok = bool(data[0].get("embedding"))
        result.error = "" if result.ok else "no embedding in the response"
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    return result


async def _read_stream(response: Any, result: RequestResult, start: float) -> None:
    last = start
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("error"):
            result.error = chunk["error"].get("message", "error")
        if not chunk.get("choices"):
            continue
        now = time.perf_counter()
        if result.ttft == 0.0:
            result.ttft = now - start
        else:
            result.itls.append(now - last)
        last = now


def summarize(
    results: list[RequestResult], duration: float, ns: argparse.Namespace
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    import numpy as np

    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "url": ns.url,
        "backend": ns.backend,
        "num_prompts": ns.num_prompts,
        "concurrency": ns.concurrency,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "input_throughput": round(len(done) * ns.input_len / duration, 2),
        "output_throughput": round(output_tokens / duration, 2),
        "tpot_ms_mean": round(1000 * float(np.mean(tpots)), 2) if tpots else None,
    }
    summary.update(_percentiles("ttft_ms", [r.ttft for r in done]))
    summary.update(_percentiles("itl_ms", [x for r in done for x in r.itls]))
    summary.update(_percentiles("e2el_ms", [r.latency for r in done]))
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def _percentiles(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p{p}": None for p in _PERCENTILES}
    import numpy as np

    points = np.percentile(np.array(values) * 1000, _PERCENTILES)
    return {f"{name}_p{p}": round(float(v), 2) for p, v in zip(_PERCENTILES, points)}


def _print_summary(s: dict[str, Any]) -> None:
    print(f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']} s")
    print(f"request throughput: {s['request_throughput']} req/s")
    print(f"input throughput:   {s['input_throughput']} tok/s")
    labels = [("e2el_ms", "E2EL")]
    if s["backend"] == "openai":
        print(f"output throughput:  {s['output_throughput']} tok/s")
        print(f"time per output token (mean): {s['tpot_ms_mean']} ms")
        labels = [("ttft_ms", "TTFT"), ("itl_ms", "ITL")] + labels
    for name, label in labels:
        values = ", ".join(f"p{p} {s[f'{name}_p{p}']}" for p in _PERCENTILES)
        print(f"{label} (ms): {values}")
    if "first_error" in s:
        print(f"first error: {s['first_error']}")
