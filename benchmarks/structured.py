"""Structured outputs' cost: 64 requests constrained by a JSON schema vs the same 64
unconstrained, in the same engine, rounds interleaved A B A B; output tok/s of each and the
ratio of the medians, and the grammar compile time per schema (cold, on this vocabulary).

The schema asks for at least 40 items, so no constrained output can finish before
`--max-tokens` (128): both sides run exactly max_tokens tokens per request (the unconstrained
side with ignore_eos), and the only difference is the grammar's work: bitmasks filled on the
host, applied on the device, matchers advanced, and (async scheduling) sampling that waits
for the previous step's tokens.

    python benchmarks/structured.py                                  # CPU, embedded SmolLM2
    python benchmarks/structured.py --num-requests 4 --max-tokens 16 --rounds 1   # smoke
    python benchmarks/structured.py --model qwen3-0.6b --load-format dummy          # CUDA

A model without a tokenizer (a shipped config with dummy weights) borrows the embedded
SmolLM2 tokenizer, its ids padded to the model's vocabulary (151936 for Qwen3): the masks
are the real width, the allowed ids SmolLM2's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 16},
                    "active": {"type": "boolean"},
                    "score": {"type": "number"},
                    "tag": {"enum": ["red", "green", "blue"]},
                },
                "required": ["id", "name", "active", "score", "tag"],
            },
        }
    },
    "required": ["records"],
}


def borrowed_tokenizer() -> str:
    """The embedded SmolLM2's tokenizer folder (converted from its GGUF file once)."""
    from pagellm.loader import resolve_model_source
    from pagellm.loader.tokenizer import gguf_tokenizer, tokenizer_cache_dir

    path = resolve_model_source(None, "auto", None).path
    gguf_tokenizer(path)
    return str(tokenizer_cache_dir(path))


def make_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 20000) for _ in range(rng.randint(32, 128))] for _ in range(num)]


def run_round(llm, prompts: list[list[int]], params) -> float:
    """Output tok/s of one generate call over `prompts`, from a cleared prefix cache."""
    assert llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def compile_ms(llm, repeats: int) -> float:
    """Median cold compile time of SCHEMA on the model's vocabulary, in ms."""
    from pagellm.structured_output.backend import XgrammarBackend, tokenizer_info
    from pagellm.structured_output.manager import stop_token_ids
    from pagellm.structured_output.params import StructuredOutputsParams

    tokenizer, mc = llm.get_tokenizer(), llm.llm_engine.config.model_config
    stop_ids = stop_token_ids(mc, tokenizer.eos_token_id)
    backend = XgrammarBackend(tokenizer_info(tokenizer, mc.vocab_size, stop_ids))
    key = StructuredOutputsParams(json=SCHEMA).key()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.compile(key)  # the backend keeps no cache: every call compiles
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--tokenizer", default=None, help="default: the model's, else SmolLM2's")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams, StructuredOutputsParams
    from pagellm.loader import load_tokenizer, resolve_model_source

    tokenizer = args.tokenizer
    source = resolve_model_source(args.model, args.load_format, None)
    if tokenizer is None and load_tokenizer(source) is None:
        tokenizer = borrowed_tokenizer()
    llm = LLM(
        model=args.model, load_format=args.load_format, tokenizer=tokenizer,
        async_scheduling=args.async_scheduling, max_model_len=1024,
    )  # fmt: skip
    prompts = make_prompts(args.num_requests, seed=0)
    constrained = SamplingParams(
        temperature=0.6, seed=0, max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )  # fmt: skip
    free = SamplingParams(temperature=0.6, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    run_round(llm, prompts[:2], [constrained, free])  # warm-up: imports, first compile
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for r in range(args.rounds):
        rates["constrained"].append(run_round(llm, prompts, constrained))
        rates["unconstrained"].append(run_round(llm, prompts, free))
        print(
            f"round {r}: constrained {rates['constrained'][-1]:.1f} tok/s, "
            f"unconstrained {rates['unconstrained'][-1]:.1f} tok/s"
        )
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "model": llm.llm_engine.config.model_config.model,
        "device": llm.llm_engine.config.device,
        "async_scheduling": llm.llm_engine.config.async_scheduling,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "constrained_tok_s": round(med["constrained"], 1),
        "unconstrained_tok_s": round(med["unconstrained"], 1),
        "slowdown_pct": round(100 * (1 - med["constrained"] / med["unconstrained"]), 1),
        "compile_ms_per_schema": round(compile_ms(llm, repeats=3), 2),
        "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
    }
    llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
