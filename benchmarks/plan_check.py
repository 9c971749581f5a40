"""`pagellm plan` against the engine: the KV tokens it predicts and those the engine sizes.

For each case (a shipped config with dummy weights, and engine flags) the engine starts on
this machine's device and reports its KV blocks, weight bytes and (on a GPU) the profiling
step's measured peak and non-torch memory; then the planner predicts the same from the
config, for a GPU of the size the engine found (the planner never touches the GPU here: a
CUDA context in this process would count against the engine's memory). One JSON line per
case on stderr, one JSON line with all of them at the end; `ratio` is predicted / actual KV
tokens (the goal: within 0.9 .. 1.1 on a GPU; exactly 1 on the CPU).

    python benchmarks/plan_check.py                  # CUDA: qwen3-0.6b, llama-3.1-8b, ...
    python benchmarks/plan_check.py --device cpu     # smollm2-135m and qwen3-0.6b, exact
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# run as a script, this folder leads sys.path: a script named like a package would shadow it
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

GiB = 1 << 30
CUDA_CASES = [
    ("qwen3-0.6b", {}),
    ("qwen3-0.6b", {"kv_cache_dtype": "fp8", "max_num_seqs": 64}),
    ("llama-3.1-8b", {}),
    ("llama-3.1-8b", {"max_model_len": 32768, "max_num_batched_tokens": 16384}),
    ("qwen3-30b-a3b", {}),
]
CPU_CASES = [
    ("smollm2-135m", {"kv_cache_memory_bytes": 256 << 20}),
    ("qwen3-0.6b", {"kv_cache_dtype": "fp8", "max_model_len": "auto"}),
]


def actual(model: str, flags: dict, device: str) -> dict:
    """The engine's own numbers for one case (started, measured, shut down)."""
    from pagellm import LLM

    llm = LLM(model, load_format="dummy", device=device, **flags)
    try:
        engine = llm.llm_engine
        rank = engine.call_utility("collective_rpc", "describe", [])[0]
        return {
            "num_blocks": engine.call_utility("get_num_kv_blocks"),
            "max_model_len": engine.config.model_config.max_model_len,
            **rank,
        }
    finally:
        llm.shutdown()


def predicted(model: str, flags: dict, device: str, total: int | None) -> dict:
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.plan import plan_memory

    args = EngineArgs(model=model, load_format="dummy", device=device, **flags)
    return plan_memory(args, None if total is None else total / GiB).to_json()


def check(model: str, flags: dict, device: str) -> dict:
    start = time.perf_counter()
    real = actual(model, flags, device)
    profiled = real.get("profiled") or {}
    plan = predicted(model, flags, device, profiled.get("total"))
    block_size = plan["block_size"]
    tokens = (real["num_blocks"] - 1) * block_size
    reserved = plan["reserved"]
    peak = sum(v for k, v in reserved.items() if k not in ("not_torch", "margin"))
    return {
        "model": model,
        "flags": flags,
        "device": device,
        "predicted_kv_tokens": plan["kv_tokens"],
        "actual_kv_tokens": tokens,
        "ratio": round(plan["kv_tokens"] / tokens, 4) if tokens else None,
        "predicted_max_model_len": plan["max_model_len_auto"],
        "actual_max_model_len": real["max_model_len"],
        "predicted_weight_bytes": plan["weight_bytes"],
        "actual_weight_bytes": real["weight_bytes"],
        "predicted_peak_bytes": peak if reserved else None,
        "actual_peak_bytes": profiled.get("peak"),
        "predicted_not_torch_bytes": reserved.get("not_torch"),
        "actual_not_torch_bytes": profiled.get("not_torch"),
        "predicted_reserved": reserved,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", nargs="*", default=None, help="only these shipped configs")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="capture them (slower; no effect on the KV)"
    )
    ns = parser.parse_args()
    cases = CUDA_CASES if ns.device == "cuda" else CPU_CASES
    results = []
    for model, flags in cases:
        if ns.models and model not in ns.models:
            continue
        if ns.device == "cuda" and not ns.cuda_graphs:
            flags = {**flags, "enforce_eager": True}  # graphs are captured after the sizing
        try:
            result = check(model, flags, ns.device)
        except Exception as e:  # one case failing (out of memory) leaves the others
            result = {"model": model, "flags": flags, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), file=sys.stderr, flush=True)
        results.append(result)
    ratios = [r["ratio"] for r in results if r.get("ratio")]
    worst = max(ratios, key=lambda r: abs(r - 1)) if ratios else None
    print(json.dumps({"device": ns.device, "worst_ratio": worst, "results": results}))


if __name__ == "__main__":
    main()
