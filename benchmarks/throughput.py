"""Offline throughput: pagellm vs a peer on the same requests, in the same run, interleaved.

CPU workload (default): 64 requests on the embedded SmolLM2-135M, prompts of 32-256 random
token ids, 128 output tokens each, greedy, ignore_eos. The peer is HF transformers
`generate` in static batches of 8 with left padding. Rounds alternate A B A B and the
medians are compared (this machine's speed swings between runs).

    python benchmarks/throughput.py                     # pagellm vs HF, 2 rounds
    python benchmarks/throughput.py --peer none         # pagellm only
    python benchmarks/throughput.py --peer inproc       # multiprocess vs in-process pagellm

The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch


def make_requests(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 20000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def run_pagellm(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def load_hf():
    from transformers import AutoModelForCausalLM

    from pagellm.loader import resolve_model_source

    path = resolve_model_source(None, "auto", None).path
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def run_hf(model, prompts: list[list[int]], max_tokens: int, batch_size: int = 8) -> float:
    pad = 2
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + max_tokens
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer", choices=["hf", "inproc", "none"], default="hf")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()

    from pagellm import LLM

    prompts = make_requests(args.num_requests, args.min_prompt, args.max_prompt, seed=0)
    total_out = args.num_requests * args.max_tokens
    llm = LLM(dtype="float32", max_num_seqs=args.max_num_seqs)
    runners = {"pagellm": lambda p: run_pagellm(llm, p, args.max_tokens)}
    if args.peer == "hf":
        hf = load_hf()
        runners["hf"] = lambda p: run_hf(hf, p, args.max_tokens)
    elif args.peer == "inproc":
        os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"
        inproc = LLM(dtype="float32", max_num_seqs=args.max_num_seqs)
        runners["pagellm-inproc"] = lambda p: run_pagellm(inproc, p, args.max_tokens)

    for run in runners.values():  # warm-up, not timed
        run(prompts[:2])
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):  # A B A B
        for name, run in runners.items():
            times[name].append(run(prompts))
            print(f"round {r}: {name:15s} {total_out / times[name][-1]:8.1f} output tok/s", flush=True)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "workload": vars(args),
        "output_tok_s": {n: round(total_out / statistics.median(t), 1) for n, t in times.items()},
        "runs_s": {n: [round(x, 2) for x in t] for n, t in times.items()},
    }
    names = list(runners)
    if len(names) == 2:
        a, b = (result["output_tok_s"][n] for n in names)
        result["ratio"] = round(a / b, 2)
        print(f"{names[0]} / {names[1]}: {result['ratio']}x (medians)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
