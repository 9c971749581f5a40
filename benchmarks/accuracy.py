"""Accuracy of a cheaper precision against a reference one, on the same weights.

    python benchmarks/accuracy.py                                  # fp8 KV vs fp32 KV, CPU
    python benchmarks/accuracy.py --dtype bfloat16                 # fp8 KV vs bf16 KV
    python benchmarks/accuracy.py --kv-cache-dtype fp8_e5m2
    python benchmarks/accuracy.py --calculate-kv-scales             # scales from batch 1
    python benchmarks/accuracy.py --model qwen3-0.6b --load-format dummy --dtype bfloat16
                                                  # GPU, random weights, random prompt ids
    python benchmarks/accuracy.py ... --quantization fp8 --kv-cache-dtype auto   # fp8 weights
    python benchmarks/accuracy.py ... --quantization fp8                         # both

The reference engine runs `--dtype` with `kv_cache_dtype="auto"`, the candidate the same
with `--kv-cache-dtype` (scales 1.0, or with `--calculate-kv-scales` from the first batch:
the prompts' prefill) and `--quantization` (default none: the weights as the reference has
them; dummy weights are drawn the same before fp8 quantizes them); both in this process,
one after the other (embedded SmolLM2-135M by default: its real weights). Over PROMPTS
(64 prompts, 32 greedy tokens each):

- top1_agreement: teacher-forced greedy agreement. Along the reference's greedy
  continuation, the share of the 32 positions where the candidate's most likely next token
  is the reference's (each position sees the same prefix, so one early flip does not drag
  the rest along). The regression test `tests/test_fp8_kv.py` keeps this >= 90%.
- mean_kl: mean KL(reference || candidate) of the next-token distributions at those
  positions, in nats.
- identical_continuations / mean_common_prefix: free-running greedy decoding, the share of
  prompts whose 32 tokens are all the reference's, and the mean length of the common start.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a little robot who",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a transformer is",
    "My favourite recipe for pancakes:",
    "The quick brown fox",
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "List five fruits that are red.",
    "How do I reverse a list in Python?",
    "The largest planet in our solar system is",
    "Translate 'good night' into Spanish:",
    "A healthy breakfast should include",
    "The main causes of the French Revolution were",
    "import numpy as np\n\ndef normalize(x):",
    "Photosynthesis is the process by which",
    "Give three tips for learning a new language.",
    "The first person to walk on the moon was",
    "SELECT name FROM users WHERE",
    "Dear hiring manager, I am writing to apply for",
    "The boiling point of water at high altitude is lower because",
    "A haiku about the ocean:",
    "What are the benefits of regular exercise?",
    "In 1492, Christopher Columbus",
    "The function of the heart is to",
    "Summarize the plot of Romeo and Juliet.",
    "To make a cup of tea, first",
    "The speed of light is approximately",
    "Why do cats purr?",
    "Here is a JavaScript function that adds two numbers:",
    "The Great Wall of China was built to",
    "Three things every programmer should know are",
    "Describe a sunset over the mountains.",
    "How many legs does a spider have?",
    "The theory of evolution states that",
    "My weekend plans are",
    "A good password should",
    "The difference between weather and climate is",
    "Write a limerick about a cat.",
    "Mount Everest is located in",
    "The best way to save money is",
    "class Stack:\n    def __init__(self):",
    "What causes earthquakes?",
    "The human brain contains about",
    "An example of a renewable energy source is",
    "Tell me a fun fact about octopuses.",
    "The Pythagorean theorem states that",
    "If it rains tomorrow, we will",
    "The most popular sport in the world is",
    "Steps to bake bread at home:",
    "A noun is a word that",
    "Why is sleep important for health?",
    "The chemical symbol for gold is",
    "In a galaxy far, far away,",
    "The advantages of electric cars include",
    "for i in range(10):",
    "Shakespeare wrote many plays, including",
    "How does a rainbow form?",
    "The key to a successful interview is",
    "Bees are important because",
    "The year 2000 was special because",
]


def greedy(llm, prompts: list, max_tokens: int) -> list[list[int]]:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompt_ids(llm, prompts: list[str]) -> list[list[int]]:
    from pagellm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    return [o.prompt_token_ids for o in outs]


def teacher_forced_top1(llm, prompts: list[list[int]], conts: list[list[int]]) -> list[list[int]]:
    """The most likely next token at each continuation position, the prefix being the prompt
    and the continuation before it (prompt_logprobs: the rank-1 entry of each position)."""
    from pagellm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    seqs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, conts)]
    tops = []
    for out, p, c in zip(llm.generate(seqs, params, use_tqdm=False), prompts, conts):
        entries = out.prompt_logprobs[len(p) : len(p) + len(c)]  # predicting c[0] .. c[-1]
        tops.append([next(t for t, lp in e.items() if lp.rank == 1) for e in entries])
    return tops


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where a and b hold the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def next_token_logprobs(llm, prompts: list[list[int]], conts: list[list[int]]) -> list:
    """[len(cont), vocab] float32 log-softmax rows at each continuation position (in-process
    engines only: the runner's compute_logits is wrapped while one request runs)."""
    from pagellm import SamplingParams

    model = llm.llm_engine.engine_core.engine_core.model_executor.model_runner.model
    captured: list[torch.Tensor] = []
    plain = model.compute_logits

    def capturing(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(plain(hidden))
        return captured[-1]

    model.compute_logits = capturing
    rows = []
    try:
        for p, c in zip(prompts, conts):
            captured.clear()
            seq = {"prompt_token_ids": p + c}
            llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            # prompt positions first (one call per chunk), the sampled row last
            logits = torch.cat(captured[:-1]).float()  # [len(p) + len(c) - 1, vocab]
            rows.append(logits[len(p) - 1 :].log_softmax(-1))
    finally:
        model.compute_logits = plain
    return rows


def mean_kl(ref: list[torch.Tensor], cand: list[torch.Tensor]) -> float:
    kl = [(r.exp() * (r - c)).sum(-1) for r, c in zip(ref, cand)]  # [len(cont)] each
    return torch.cat(kl).mean().item()


def measure(args: argparse.Namespace, kv_cache_dtype: str, ref: dict | None) -> dict:
    from pagellm import LLM

    engine = dict(model=args.model, load_format=args.load_format, dtype=args.dtype)
    engine["quantization"] = "none"  # the reference: the weights as they are
    if ref is not None:
        engine["calculate_kv_scales"] = args.calculate_kv_scales
        engine["quantization"] = args.quantization
    with LLM(**engine, max_model_len=1024, kv_cache_dtype=kv_cache_dtype, seed=0) as llm:
        if args.load_format == "dummy":  # shipped configs have no tokenizer: random ids
            rng = random.Random(0)
            ids = [[rng.randint(0, 10000) for _ in range(rng.randint(8, 40))]
                   for _ in PROMPTS[: args.num_prompts]]  # fmt: skip
        else:
            ids = prompt_ids(llm, PROMPTS[: args.num_prompts])  # the first batch
        free = greedy(llm, [{"prompt_token_ids": p} for p in ids], args.max_tokens)
        conts = ref["free"] if ref else free
        return {
            "prompt_ids": ids,
            "free": free,
            "top1": teacher_forced_top1(llm, ids, conts),
            "logprobs": next_token_logprobs(llm, ids, conts),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--calculate-kv-scales", action="store_true")
    p.add_argument("--quantization", default="none", help="the candidate's (fp8: weights)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"  # next_token_logprobs reads the runner
    start = time.perf_counter()
    ref = measure(args, "auto", None)
    cand = measure(args, args.kv_cache_dtype, ref)
    n = len(ref["free"])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "model": args.model or "embedded SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "dtype": args.dtype,
        "reference": "kv_cache_dtype=auto",
        "candidate": f"kv_cache_dtype={args.kv_cache_dtype}, quantization={args.quantization}"
        + (", calculate_kv_scales" if args.calculate_kv_scales else ""),
        "prompts": n,
        "tokens": args.max_tokens,
        "top1_agreement": round(agreement(ref["top1"], cand["top1"]), 4),
        "mean_kl": round(mean_kl(ref["logprobs"], cand["logprobs"]), 5),
        "identical_continuations": sum(a == b for a, b in zip(ref["free"], cand["free"])) / n,
        "mean_common_prefix": sum(map(common_prefix, ref["free"], cand["free"])) / n,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
