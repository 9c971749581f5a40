"""Greedy agreement of a quantized model with the same model unquantized: 64 varied prompts
(code, chat, facts, stories, other languages), 32 greedy tokens each; a continuation agrees
when all 32 token ids are identical. Also the mean number of leading tokens that agree.

    python benchmarks/quant_accuracy.py                            # embedded Q4_1: gguf vs none
    python benchmarks/quant_accuracy.py --quantization int8
    python benchmarks/quant_accuracy.py --model llama-3.1-8b --load-format dummy \\
        --quantization fp8 --reference none                        # CUDA: fp8 vs bf16

On the CPU the int kernels serve GEMMs of up to PAGELLM_CPU_QUANT_MAX_ROWS rows (batch-1
decode) and the dequantized copy the rest (prefill). Their rows are computed independently
(checked in tests/test_quantization_cpu.py), so this script runs the 64 prompts as one batch
with the limit raised to the batch size: every decode step takes the int path, every
prefill the dense one, as a lone request would (`--all-int` sends prefill through the int
kernels too). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

PROMPTS = [
    # code
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):",
    "// Reverse a linked list in C\nstruct node *reverse(struct node *head) {",
    "SELECT name, COUNT(*) FROM orders",
    "class Stack:\n    def __init__(self):",
    "#!/bin/bash\n# Back up every .txt file in the current folder",
    "function debounce(fn, ms) {",
    "fn main() {\n    let v: Vec<i32> =",
    "The time complexity of binary search is",
    "# Python: read a CSV file with pandas and",
    "public static int gcd(int a, int b) {",
    "<html>\n<head>\n<title>",
    # chat (SmolLM2's template, written out)
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me three tips for sleeping better.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHow do I make a cup of tea?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain photosynthesis to a child.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSuggest a name for a black cat.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nTranslate 'good morning' into Spanish.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat should I pack for a beach trip?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSummarize the plot of Romeo and Juliet.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nIs coffee bad for you?<|im_end|>\n<|im_start|>assistant\n",
    # facts
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "Albert Einstein was born in",
    "The chemical symbol for gold is",
    "The Great Wall of China was built to",
    "Photosynthesis is the process by which",
    "The speed of light in a vacuum is approximately",
    "The human heart has four chambers:",
    "World War II ended in the year",
    "The mitochondria is known as",
    "Mount Everest is located in",
    # stories
    "Once upon a time, in a small village by the sea,",
    "The dragon opened one eye and said",
    "It was a dark and stormy night when",
    "The robot had never seen snow before.",
    "She found an old key under the floorboards and",
    "On the first day of school, Tom",
    "The last train left the station at midnight, and",
    "In the year 3000, humans",
    "The cat knocked the glass off the table and",
    "Long ago, before the mountains had names,",
    "The detective looked at the clock and realized",
    "My grandmother always told me that",
    # other languages
    "La capitale de l'Italie est",
    "Il était une fois un petit garçon qui",
    "El perro corre por el parque porque",
    "Der schnellste Weg nach Berlin ist",
    "Ciao! Come stai? Oggi",
    "O Brasil é famoso por",
    "Hoy vamos a aprender cómo",
    "Je voudrais réserver une table pour",
    "Das Wetter heute ist",
    "東京は日本の",
    # lists, math, misc
    "Here are five fruits: apple,",
    "1, 2, 3, 5, 8, 13,",
    "The recipe needs the following ingredients:",
    "Step 1: Preheat the oven to",
    "Q: What is the square root of 144?\nA:",
    "Dear Sir or Madam,\n\nI am writing to",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--reference", default="none", help="the reference's quantization")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="both engines' (auto: bf16 on AMX CPUs)")
    p.add_argument("--all-int", action="store_true", help="prefill through the int kernels too")
    return p.parse_args()


def generate(args: argparse.Namespace, quantization: str) -> tuple[list[list[int]], float]:
    from pagellm import LLM, SamplingParams

    llm = LLM(
        model=args.model, load_format=args.load_format, quantization=quantization,
        dtype=args.dtype,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    args = parse_args()
    assert len(PROMPTS) == 64
    # decode steps (64 rows) through the int kernels; prefill (>64 rows) dense, or int too
    os.environ["PAGELLM_CPU_QUANT_MAX_ROWS"] = str(10**9 if args.all_int else len(PROMPTS))
    ref, ref_s = generate(args, args.reference)
    got, got_s = generate(args, args.quantization)
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    lead = [leading_agreement(a, b) for a, b in zip(ref, got, strict=True)]
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a != b:
            print(f"prompt {i}: diverges at token {leading_agreement(a, b)}")
    result = {
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "quantization": args.quantization,
        "reference": args.reference,
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "prefill_through_int": args.all_int,
        "identical_continuations": same,
        "agreement": round(same / len(PROMPTS), 4),
        "mean_leading_tokens_agreeing": round(sum(lead) / len(lead), 2),
        "seconds": {"reference": round(ref_s, 1), "quantized": round(got_s, 1)},
        "machine": platform.machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
