"""Offline throughput: pagellm vs a peer on the same requests, in the same run, interleaved.

CPU workload (default): 64 requests on the embedded SmolLM2-135M, prompts of 32-256 random
token ids, 128 output tokens each, greedy, ignore_eos. The peer is HF transformers
`generate` in static batches of 8 with left padding. Rounds alternate A B A B and the
medians are compared (this machine's speed swings between runs).

    python benchmarks/throughput.py                     # pagellm vs HF, 3 rounds
    python benchmarks/throughput.py --peer none         # pagellm only
    python benchmarks/throughput.py --peer inproc       # multiprocess vs in-process pagellm
    python benchmarks/throughput.py --num-requests 1 --max-num-seqs 1 --min-prompt 64 \
        --max-prompt 64 --peer unquantized          # batch 1: GGUF blocks (the default for
                                                    # GGUF files) vs dequantized float32
    python benchmarks/throughput.py --num-requests 1 --max-num-seqs 1 --min-prompt 64 \
        --max-prompt 64 --peer llama.cpp            # the same against llama.cpp on the file
    python benchmarks/throughput.py --dtype bfloat16 ...    # the engine in bf16 (CPU)

`--peer llama.cpp` runs llama-cpp-python (installed by hand: it builds llama.cpp, ~7
minutes here) on the same GGUF file with torch's thread count, one request at a time.

GPU workloads (`--workload standard | fixed512 | batch1`, pagellm alone unless `--peer hf`):

    python benchmarks/throughput.py --workload standard --model qwen3-0.6b --load-format dummy
    python benchmarks/throughput.py --workload fixed512 --model qwen3-0.6b --load-format dummy
    python benchmarks/throughput.py --workload batch1 --model llama-3.1-8b --load-format dummy
    python benchmarks/throughput.py --workload batch1 --model llama-3.1-8b --load-format dummy \
        --quantization fp8
    python benchmarks/throughput.py --workload batch1 --model llama-3.1-8b --load-format dummy \
        --quantization gptq                     # int4, groups of 128 (also awq)
    python benchmarks/throughput.py --workload standard --model qwen3-30b-a3b \
        --load-format dummy --quantization gptq # int4 experts in the fused MoE kernel

`standard` is nano-vllm's bench.py, generated in its order: `random.seed(0)`; 256 prompts of
`randint(100, 1024)` token ids each drawn with `randint(0, 10000)`; then 256
`max_tokens = randint(100, 1024)`; temperature 0.6, ignore_eos; one short warm-up generate;
output tok/s = sum(max_tokens) / wall time, the median of `--rounds` rounds. The prefix cache
is reset before every round (pagellm and vLLM both cache prompts: a round after the first
would otherwise skip most of its prefill). `fixed512` uses the same prompts with 512 output
tokens each. `batch1` is one request of 128 random token ids and 512 output tokens (latency
of a lone stream). `--no-async-scheduling` turns async scheduling off. `--peer hf` also runs
HF transformers' `generate_batch` (continuous batching, paged attention) on the first
`--peer-requests` requests with the same settings. Start-up (`LLM(...)` to ready) is timed.
`--quantization` is the engine's (`fp8` quantizes the dummy bf16 weights at load, MoE experts
included; `awq` / `gptq` / `compressed-tensors` draw random int4 weights in groups of 128 at
the format's layout, the checkpoint a user downloads without downloading it; on the CPU
`gguf` keeps the embedded GGUF's blocks quantized, the default dequantizes them), and
`--peer unquantized` runs the same engine with `quantization="none"` beside it.

`--tensor-parallel-size N` (`-tp N`) splits the model over N GPUs (N worker processes;
`--distributed-executor-backend ray` for Ray actors), on any workload:

    python benchmarks/throughput.py --workload batch1 --model llama-3.1-70b -tp 2

The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import statistics
import time

import torch

# Qwen3-0.6B, standard workload: 14.9 TB of K/V + 1.3 TB of weight reads at ~4.2 TB/s
PHYSICAL_BOUND_TOK_S = 35_000


def make_requests(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randint(100, 20000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)
    ]


def run_pagellm(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    assert llm.reset_prefix_cache()  # every round computes its prompts: no hits on the last
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


def load_llama_cpp():
    """llama.cpp (llama-cpp-python) on the embedded GGUF file, with torch's thread count."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "--peer llama.cpp needs llama-cpp-python (`pip install llama-cpp-python` builds "
            "llama.cpp from source, ~7 minutes on 2 cores; not a pagellm dependency)"
        ) from None
    from pagellm.loader import resolve_model_source

    path = resolve_model_source(None, "auto", None).path
    threads = torch.get_num_threads()
    return Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, verbose=False)  # fmt: skip


def run_llama_cpp(model, prompts: list[list[int]], max_tokens: int) -> float:
    """One request at a time (llama.cpp's own loop: prefill, then greedy tokens, EOS not
    checked), max_tokens each."""
    start = time.perf_counter()
    for prompt in prompts:
        for n, _ in enumerate(model.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
            if n == max_tokens:
                break
    return time.perf_counter() - start


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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["cpu", "standard", "fixed512", "batch1"], default="cpu")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--peer", choices=["hf", "inproc", "unquantized", "llama.cpp", "none"], default=None
    )
    ap.add_argument("--dtype", default="float32", help="CPU: the engine's (bfloat16, auto)")
    ap.add_argument("--quantization", default=None, help="the engine's; default: its default")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--model", default="qwen3-0.6b", help="GPU workloads only")
    ap.add_argument("--load-format", default="dummy", help="GPU workloads only")
    ap.add_argument("--enforce-eager", action="store_true", help="GPU workloads only")
    ap.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="GPU workloads only; default: the engine's (on for CUDA)",
    )  # fmt: skip
    ap.add_argument("--peer-requests", type=int, default=32, help="HF peer on GPU: how many")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | fp8_e5m2")
    ap.add_argument(
        "--speculative-config", default=None, metavar="JSON", help="GPU workloads: the engine's"
    )
    ap.add_argument("--concurrency", type=int, default=1, help="batch1 workload: requests")
    ap.add_argument("--trace", default=None, help="record a journey trace there (its overhead)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--distributed-executor-backend", default=None, help="mp | ray (None: mp)")
    args = ap.parse_args()
    gpu = args.workload != "cpu"
    args.peer = args.peer or ("none" if gpu else "hf")
    args.max_num_seqs = args.max_num_seqs or (256 if gpu else 64)
    return args


CPU_ONLY = ("num_requests", "min_prompt", "max_prompt", "max_tokens", "dtype")
GPU_ONLY = ("model", "load_format", "enforce_eager", "async_scheduling", "peer_requests")


def workload_of(args: argparse.Namespace) -> dict:
    """The arguments that shaped this run (the other path's options left out)."""
    skip = GPU_ONLY if args.workload == "cpu" else CPU_ONLY
    return {k: v for k, v in vars(args).items() if k not in skip}


def main() -> None:
    args = parse_args()
    if args.workload != "cpu":
        return main_gpu(args)

    from pagellm import LLM

    prompts = make_requests(args.num_requests, args.min_prompt, args.max_prompt, seed=0)
    total_out = args.num_requests * args.max_tokens
    tp = dict(
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        trace=args.trace,
        **tp,
    )
    runners = {"pagellm": lambda p: run_pagellm(llm, p, args.max_tokens)}
    if args.peer == "hf":
        hf = load_hf()
        runners["hf"] = lambda p: run_hf(hf, p, args.max_tokens)
    elif args.peer == "inproc":
        os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"
        inproc = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs)
        runners["pagellm-inproc"] = lambda p: run_pagellm(inproc, p, args.max_tokens)
    elif args.peer == "unquantized":
        plain = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, quantization="none")
        runners["pagellm-unquantized"] = lambda p: run_pagellm(plain, p, args.max_tokens)
    elif args.peer == "llama.cpp":
        cpp = load_llama_cpp()
        runners["llama.cpp"] = lambda p: run_llama_cpp(cpp, p, args.max_tokens)

    for run in runners.values():  # warm-up, not timed
        run(prompts[:2])
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):  # A B A B
        for name, run in runners.items():
            times[name].append(run(prompts))
            print(
                f"round {r}: {name:15s} {total_out / times[name][-1]:8.1f} output tok/s", flush=True
            )

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "workload": workload_of(args),
        "quantization": llm.llm_engine.config.model_config.quantization,
        "output_tok_s": {n: round(total_out / statistics.median(t), 1) for n, t in times.items()},
        "runs_s": {n: [round(x, 2) for x in t] for n, t in times.items()},
    }
    names = list(runners)
    if len(names) == 2:
        a, b = (result["output_tok_s"][n] for n in names)
        result["ratio"] = round(a / b, 2)
        print(f"{names[0]} / {names[1]}: {result['ratio']}x (medians)")
    llm.shutdown()  # writes the trace, if one was asked for
    print(json.dumps(result))


# ---- GPU workloads -----------------------------------------------------------------------


def standard_requests(fixed_max_tokens: int | None) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py requests, drawn in its order from random.seed(0)."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    return prompts, [fixed_max_tokens] * 256 if fixed_max_tokens else max_tokens


def main_gpu(args: argparse.Namespace) -> None:
    if args.workload == "batch1":  # --concurrency N: N such requests at once
        rng = random.Random(0)
        prompts = [[rng.randint(0, 10000) for _ in range(128)] for _ in range(args.concurrency)]
        max_tokens = [512] * args.concurrency
    else:
        prompts, max_tokens = standard_requests(512 if args.workload == "fixed512" else None)
    start = time.perf_counter()
    from pagellm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        trace=args.trace,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=args.speculative_config,
    )
    ready = time.perf_counter()
    warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], warm, use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    times = []
    for r in range(args.rounds):
        assert llm.reset_prefix_cache()  # every round computes its prompts: no hits on the last
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
        print(f"round {r}: pagellm {sum(max_tokens) / times[-1]:9.1f} output tok/s "
              f"({times[-1]:.2f} s)", flush=True)  # fmt: skip
    stats = llm.llm_engine.engine_core.call_utility("get_stats")
    spec = {k: v for k, v in stats.items() if k.startswith("spec_decode")}
    llm.shutdown()
    median = sum(max_tokens) / statistics.median(times)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "?",
        "torch": torch.__version__,
        "workload": workload_of(args),
        "total_output_tokens": sum(max_tokens),
        "output_tok_s": {"pagellm": round(median, 1)},  # median round
        "best_round_tok_s": round(sum(max_tokens) / min(times), 1),
        "runs_s": {"pagellm": [round(x, 2) for x in times]},
        "startup_s": {"import": round(imported - start, 2), "LLM()": round(ready - imported, 2)},
    }
    if args.speculative_config:
        result["speculative_config"] = args.speculative_config
        result["spec_decode"] = spec
    if args.workload == "standard" and "0.6b" in args.model.lower():
        result["fraction_of_physical_bound"] = round(median / PHYSICAL_BOUND_TOK_S, 3)
        share = median / PHYSICAL_BOUND_TOK_S
        print(f"median {median:.0f} tok/s = {share:.1%} of the ~35,000 tok/s bound")
    if args.peer == "hf":
        result["hf_generate_batch"] = run_hf_generate_batch(args, prompts, max_tokens)
    print(json.dumps(result))


def run_hf_generate_batch(args, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """HF transformers' continuous batching (`generate_batch`) on the first N requests, with
    the same dummy-weight shapes; requests share one max_new_tokens (the subset's mean)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from pagellm.loader import resolve_model_source

    n = args.peer_requests
    source = resolve_model_source(args.model, args.load_format, None)
    config = AutoConfig.from_pretrained(source.path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    new = round(statistics.mean(max_tokens[:n]))
    gen = GenerationConfig(
        max_new_tokens=new, do_sample=True, temperature=0.6, pad_token_id=0, eos_token_id=-1
    )
    # Each generate_batch call builds its manager (static tensors sized for the workload,
    # CUDA-graph warm-up) unless it is kept: ~9 s of set-up per call for a tiny model on a
    # CPU. Keep it where this transformers can, run the same requests once to build and warm
    # it, and time the second run (pagellm's LLM() start-up is not timed either).
    keep = "persistent_manager" in inspect.signature(model.generate_batch).parameters
    kwargs = {"persistent_manager": True} if keep else {}
    model.generate_batch(inputs=prompts[:n], generation_config=gen, **kwargs)  # set-up, warm-up
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts[:n], generation_config=gen, **kwargs)
    elapsed = time.perf_counter() - t0
    if keep:
        model.destroy_cached_continuous_batching_manager()
    try:  # tokens actually generated (an EOS may stop a request early)
        tokens = sum(len(r.generated_tokens) for r in out.values())
    except AttributeError:
        tokens = n * new
    tok_s = tokens / elapsed
    print(f"HF generate_batch: {n} requests, {tokens} tokens: {tok_s:.1f} output tok/s "
          f"(manager kept between the runs: {keep})", flush=True)  # fmt: skip
    return {
        "requests": n, "max_new_tokens": new, "tokens": tokens, "output_tok_s": round(tok_s, 1),
        "set_up_excluded": keep,
    }  # fmt: skip


if __name__ == "__main__":
    main()
