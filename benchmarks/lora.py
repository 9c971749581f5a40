"""Multi-LoRA throughput: requests spread over several adapters vs the same requests without
LoRA, in the same run, interleaved.

CPU (default): the embedded SmolLM2-135M-Instruct (`--dtype` float32), `--num-adapters` (4)
PEFT adapters of rank `--rank` (16) on q/k/v/o/gate/up/down, A and B random (seeded; PEFT
starts B at zero, which would change nothing), written as PEFT folders (peft's
`LoraConfig.save_pretrained`, tensors under PEFT's key names). Two workloads, each timed
with adapters (request i under adapter i mod N, one engine with `enable_lora`, `max_loras`
= N) and without (a second engine, no `enable_lora`), on the same prompts:
- `batch1`: `--batch1-requests` (4) requests one after another (one `generate` each), 64
  prompt tokens, `--max-tokens` (64) output tokens: every step is one row of one adapter.
- `batched`: `--num-requests` (16) requests of 32-128 prompt tokens in one `generate` with
  `--max-num-seqs` (8): decode steps mix the adapters.
Rounds alternate A B A B (this machine's speed swings); output tok/s each, with the 1-minute
load average beside each figure; the ratio (LoRA / none) of the medians and of the best
rounds. The issue's bar: >= 0.8x.

    python benchmarks/lora.py --threads 1                # CPU, 3 rounds
    python benchmarks/lora.py --threads 1 --rounds 1 --num-requests 8 --max-tokens 16
    python benchmarks/lora.py --device cuda              # GPU: Llama-3.1-8B shape

`--model` replaces the embedded model (an HF folder: the tests' smoke run uses a tiny one).
`--device cuda`: model `--model` (llama-3.1-8b) with `load_format="dummy"` (no download), 8
rank-16 adapters on every projection, throughput.py's `standard` workload (256 requests,
nano-vllm's bench.py) with request i under adapter i mod 8, against the same engine's
requests without adapters (one engine, `max_loras` 8; rounds alternate: the no-LoRA rows
still pass the LoRA kernels, slot -1). `--separate-baseline` times no-LoRA on an engine
without `enable_lora` instead, after the LoRA engine is shut down (the issue's "pagellm's own
throughput without LoRA"; not alternated). The issue's bar: >= 0.85x. `--num-requests` cuts
the workload for a quick look:

    python benchmarks/lora.py --device cuda --num-requests 64 --rounds 2
    python benchmarks/lora.py --device cuda --separate-baseline

On a shared machine, `--threads 1` keeps other tenants' load from stalling the threads of
one parallel region on another's. Run it from outside any checkout (`cd /tmp` and
`PYTHONPATH=<checkout>`): the engine core process finds a working directory's package first
(docs/notes.md, "LoRA on the CPU"). The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# run as a script, this folder leads sys.path: a script named like a package would shadow it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

TARGETS = {  # PEFT module -> (fan_in, fan_out) from an HF config
    "self_attn.q_proj": lambda c, d: (c.hidden_size, c.num_attention_heads * d),
    "self_attn.k_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "self_attn.v_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "self_attn.o_proj": lambda c, d: (c.num_attention_heads * d, c.hidden_size),
    "mlp.gate_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "mlp.up_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "mlp.down_proj": lambda c, d: (c.intermediate_size, c.hidden_size),
}


def make_adapter(hf_config, folder: Path, rank: int, seed: int, std: float = 0.02) -> str:
    """A PEFT LoRA folder over `hf_config`'s decoder layers: every projection, rank `rank`,
    alpha 2 * rank, A and B drawn from N(0, std) with `seed`."""
    import peft
    from safetensors.torch import save_file

    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, shape in TARGETS.items():
            fan_in, fan_out = shape(hf_config, head_dim)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, task_type="CAUSAL_LM",
        target_modules=[m.rpartition(".")[2] for m in TARGETS],
    )  # fmt: skip
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def make_adapters(hf_config, root: Path, count: int, rank: int) -> list:
    from pagellm import LoRARequest

    return [
        LoRARequest(f"adapter{i}", i + 1, make_adapter(hf_config, root / f"a{i}", rank, seed=i))
        for i in range(count)
    ]


def make_prompts(num: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(20000, vocab - 1)
    return [[rng.randint(top // 200, top) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def timed_generate(llm, prompts, params, loras, one_at_a_time: bool) -> tuple[float, int]:
    """Seconds to generate every prompt (request i under loras[i], None: no adapter), and
    the output tokens."""
    assert llm.reset_prefix_cache()  # every round computes its prompts
    reqs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    if one_at_a_time:
        outs = [o for r, lora in zip(reqs, loras, strict=True)
                for o in llm.generate([r], params, use_tqdm=False, lora_request=lora)]  # fmt: skip
    else:
        outs = llm.generate(reqs, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_rounds(runners: dict, rounds: int) -> dict:
    """name -> fn() -> (seconds, tokens), alternated A B A B: tok/s and load average each."""
    result: dict[str, list] = {}
    for r in range(rounds):
        for name, fn in runners.items():
            seconds, tokens = fn()
            load = round(os.getloadavg()[0], 2)
            result.setdefault(f"tok_s_{name}", []).append(round(tokens / seconds, 1))
            result.setdefault(f"load_{name}", []).append(load)
            print(f"round {r}: {name:16s} {tokens / seconds:8.1f} output tok/s (load {load})",
                  flush=True)  # fmt: skip
    return result


def ratios(result: dict, workload: str) -> None:
    """The ratio (LoRA / none) of the median rounds, and of the best rounds (the least
    disturbed by other tenants of a shared machine), into `result`."""
    lora, none = result[f"tok_s_{workload}_lora"], result[f"tok_s_{workload}_none"]
    result[f"ratio_{workload}"] = round(statistics.median(lora) / statistics.median(none), 3)
    result[f"ratio_best_{workload}"] = round(max(lora) / max(none), 3)


def main_cpu(args: argparse.Namespace) -> dict:
    from pagellm import LLM, SamplingParams

    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    plain = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    hf_config = lora.llm_engine.config.model_config.hf_config
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(hf_config, Path(tmp), args.num_adapters, args.rank)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        vocab = hf_config.vocab_size
        one = make_prompts(args.batch1_requests, 64, 64, seed=1, vocab=vocab)
        many = make_prompts(args.num_requests, 32, 128, seed=2, vocab=vocab)

        def each(prompts):
            return [adapters[i % len(adapters)] for i in range(len(prompts))]

        runners = {
            "batch1_lora": lambda: timed_generate(lora, one, params, each(one), True),
            "batch1_none": lambda: timed_generate(plain, one, params, [None] * len(one), True),
            "batched_lora": lambda: timed_generate(lora, many, params, each(many), False),
            "batched_none": lambda: timed_generate(plain, many, params, None, False),
        }
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        # warm-up: the adapters resident, the kernels built
        timed_generate(lora, many[: args.num_adapters], warm, each(many)[: args.num_adapters],
                       False)  # fmt: skip
        timed_generate(plain, many[:2], warm, None, False)
        result = run_rounds(runners, args.rounds)
    plain.shutdown()
    lora.shutdown()
    ratios(result, "batch1")
    ratios(result, "batched")
    print(f"LoRA / none (medians): batch-1 {result['ratio_batch1']}x, batched "
          f"{result['ratio_batched']}x (bar: >= 0.8x)")  # fmt: skip
    return result


def main_cuda(args: argparse.Namespace) -> dict:
    """The Llama-3.1-8B shape, dummy weights, 8 adapters over the standard workload."""
    from pagellm import LLM, SamplingParams

    rng = random.Random(0)  # throughput.py's `standard` requests, in nano-vllm's order
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    n = args.num_requests if args.num_requests_set else 256
    prompts, max_tokens = prompts[:n], max_tokens[:n]
    model = args.model or "llama-3.1-8b"
    llm = LLM(model=model, load_format="dummy", enable_lora=True,
              max_loras=args.num_adapters, max_lora_rank=args.rank)  # fmt: skip
    hf_config = llm.llm_engine.config.model_config.hf_config
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(hf_config, Path(tmp), args.num_adapters, args.rank)
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
        timed_generate(llm, prompts[: len(adapters)], warm, spread[: len(adapters)], False)
        runners = {"standard_lora": lambda: timed_generate(llm, prompts, params, spread, False)}
        if not args.separate_baseline:
            runners["standard_none"] = lambda: timed_generate(llm, prompts, params, None, False)
        result = run_rounds(runners, args.rounds)
    llm.shutdown()
    if args.separate_baseline:  # an engine without enable_lora, after the LoRA one
        plain = LLM(model=model, load_format="dummy")
        timed_generate(plain, prompts[:8], warm, None, False)
        none = {"standard_none": lambda: timed_generate(plain, prompts, params, None, False)}
        result.update(run_rounds(none, args.rounds))
        plain.shutdown()
    ratios(result, "standard")
    result["device_name"] = torch.cuda.get_device_name()
    print(f"LoRA / none: {result['ratio_standard']}x (bar: >= 0.85x)")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-adapters", type=int, default=None, help="default: 4 CPU, 8 CUDA")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=None, help="batched (CPU: 16)")
    p.add_argument("--batch1-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="CPU workloads")
    p.add_argument("--max-num-seqs", type=int, default=8, help="CPU engines")
    p.add_argument("--dtype", default="float32", help="CPU: the engines' (bfloat16, auto)")
    p.add_argument("--model", default=None, help="CPU: the embedded model; CUDA: llama-3.1-8b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    p.add_argument(
        "--separate-baseline", action="store_true",
        help="--device cuda: time no-LoRA on an engine without enable_lora, after (not "
        "alternated with) the LoRA engine (two 8B engines do not fit one GPU at once)",
    )  # fmt: skip
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.num_adapters = args.num_adapters or (8 if cuda else 4)
    args.num_requests_set = args.num_requests is not None
    args.num_requests = args.num_requests or 16
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:  # this process and the engine cores', spawned after this
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    result = main_cuda(args) if args.device == "cuda" else main_cpu(args)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "args": {k: v for k, v in vars(args).items() if k != "num_requests_set"},
        "cpu_decoder_loop": os.environ.get("PAGELLM_CPU_DECODER_LOOP", "1"),
        **result,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
