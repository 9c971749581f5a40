"""CPU: a Qwen3-MoE model with GPTQ int4 experts kept as the block kernel's planes against the
same shape unquantized (the model dtype), alternated in one run: resident memory after
load, batch-1 decode and a prefill.

    python benchmarks/cpu_moe_int4.py                      # float32, 3 rounds
    python benchmarks/cpu_moe_int4.py --dtype bfloat16 --layers 4

The shape is Qwen3-30B-A3B's cut to fit a laptop's memory and a few minutes (hidden 1,024,
64 experts of intermediate 512, 8 of them a token, `--layers` layers, dense attention), with
random weights (`load_format="dummy"`; `quantization="gptq"` draws int4 groups of 128 for
every projection, experts included). Each run is a fresh process (`worker` mode) so that
its resident memory is its own: one request of 32 random token ids and 64 greedy tokens
(ignore_eos; tok/s over the whole request), then 4 prompts of 512 tokens, one token each
(prefill tok/s); the prefix cache reset before each. Rounds alternate int4 and unquantized;
medians. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = {"int4": "gptq", "unquantized": None}


def write_config(folder: str, layers: int) -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.num_local_experts = 64  # transformers 5's name; read by pagellm and HF alike
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(folder)


def worker(folder: str, quantization: str | None, dtype: str) -> dict:
    """One engine in this process: its memory, batch 1 and a prefill."""
    import random

    import psutil

    os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"  # the engine core in this process
    from pagellm import LLM, SamplingParams

    llm = LLM(folder, load_format="dummy", quantization=quantization, dtype=dtype,
              max_model_len=2048)  # fmt: skip
    rss = psutil.Process().memory_info().rss / 2**20
    rng = random.Random(0)
    one = [{"prompt_token_ids": [rng.randint(10, 30000) for _ in range(32)]}]
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(one, greedy, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(one, greedy, use_tqdm=False)
    batch1 = 64 / (time.perf_counter() - start)
    prompts = [{"prompt_token_ids": [rng.randint(10, 30000) for _ in range(512)]}
               for _ in range(4)]  # fmt: skip
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    prefill = 4 * 512 / (time.perf_counter() - start)
    return dict(rss_mib=round(rss), batch1_tok_s=round(batch1, 1), prefill_tok_s=round(prefill))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        folder, mode = args.worker
        print(json.dumps(worker(folder, MODES[mode], args.dtype)))
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        write_config(folder, args.layers)
        for r in range(args.rounds):
            for mode in MODES:
                cmd = [sys.executable, os.path.abspath(__file__), "--dtype", args.dtype,
                       "--worker", folder, mode]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                runs[mode].append(row)
                print(f"round {r + 1}: {mode:12s} {row}", flush=True)
    medians = {mode: {key: round(statistics.median(row[key] for row in rows), 1)
                      for key in rows[0]} for mode, rows in runs.items()}  # fmt: skip
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
                      "layers": args.layers, "medians": medians, "runs": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
