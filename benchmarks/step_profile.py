"""Where an offline run's time goes, step by step: steps with prompt tokens vs decode-only steps.

    python benchmarks/step_profile.py                                  # CPU workload
    python benchmarks/step_profile.py --workload fixed512 --model qwen3-0.6b --load-format dummy
    python benchmarks/step_profile.py --workload fixed512 --kernels    # + a kernel table (CUDA)
    python benchmarks/step_profile.py --workload batch1 --model llama-3.1-8b \
        --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --kernels
    python benchmarks/step_profile.py --workload fixed512 --model qwen3-0.6b \
        --load-format dummy --async-timeline                           # does the GPU wait?
    python benchmarks/step_profile.py --workload batch1 --model llama-3.1-8b \
        --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --graph-timeline

The engine runs in this process (`PAGELLM_ENABLE_MULTIPROCESSING=0`) with async scheduling
off, and every `ModelRunner.execute_model` call is timed between two device syncs, so each
step's time is its own (inputs, forward, sampling; not the scheduler's or the detokenizer's).
Workloads are those of `benchmarks/throughput.py`, with the prefix cache reset before each
round. `--kernels` then profiles a few decode-only steps at the workload's full batch
(eager, so every kernel shows) and prints torch.profiler's table.

This is a diagnostic, not a benchmark against a peer: sync scheduling and the syncs add
host time that the async default hides.

`--async-timeline` (CUDA) answers the other question, whether the GPU waits for the host:
the engine runs with async scheduling (the default), unsynchronized, and a CUDA event is
recorded on the stream before and after each step's work is queued. Per step: the GPU span
(first to last event of the step) and the gap before the next step's first event, which is
time the GPU sat idle waiting for the host to queue that step.

`--graph-timeline` (CUDA) looks inside a decode step as it runs: a few decode-only steps
replayed from the CUDA graphs under torch.profiler, then per kernel name the device time a
step and the launches a step, and the time between one kernel's end and the next one's start
(the price of a kernel boundary in the graph, PDL overlap counted as negative).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import make_requests, standard_requests  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def requests_of(args) -> tuple[list[list[int]], list[int]]:
    if args.workload == "cpu":
        return make_requests(64, 32, 256, seed=0), [128] * 64
    if args.workload == "batch1":  # throughput.py's: 128 random ids, 512 tokens
        rng = random.Random(0)
        return [[rng.randint(0, 10000) for _ in range(128)]], [512]
    return standard_requests(512 if args.workload == "fixed512" else None)


def engine_kwargs(args) -> dict:
    """The LLM(...) settings the flags name (quantization, KV cache dtype, dtype)."""
    kwargs = {"kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    if args.quantization:
        kwargs["quantization"] = args.quantization
    return kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["cpu", "standard", "fixed512", "batch1"], default="cpu")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (GPU)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2")
    ap.add_argument("--dtype", default="auto", help="the engine's (auto: bf16 on AMX CPUs)")
    ap.add_argument("--model", default=None, help="default: the embedded model on CPU")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="also a kernel table (CUDA)")
    ap.add_argument(
        "--async-timeline", action="store_true", help="GPU busy / idle per step, async (CUDA)"
    )
    ap.add_argument(
        "--graph-timeline", action="store_true", help="kernels of graph-replayed steps (CUDA)"
    )
    args = ap.parse_args()
    if args.async_timeline:
        return async_timeline(args)

    from pagellm import LLM
    from pagellm.worker.model_runner import ModelRunner

    steps: list[tuple[int, int, float]] = []  # (tokens, requests, seconds)
    execute = ModelRunner.execute_model

    def timed(runner, scheduler_output, *grammar):
        _sync(runner.device)
        start = time.perf_counter()
        out = execute(runner, scheduler_output, *grammar)
        _sync(runner.device)
        tokens = scheduler_output.total_num_scheduled_tokens
        steps.append(
            (tokens, len(scheduler_output.num_scheduled_tokens), time.perf_counter() - start)
        )
        return out

    ModelRunner.execute_model = timed
    gpu = args.workload != "cpu"
    llm = LLM(
        model=args.model, load_format=args.load_format, async_scheduling=False,
        max_num_seqs=256 if gpu else 64, **engine_kwargs(args),
    )  # fmt: skip
    temperature = 0.6 if gpu else 0.0
    prompts = run_rounds(
        llm, args, temperature, steps, lambda r, wall, out: report(r, wall, out, steps)
    )
    if args.kernels or args.graph_timeline:
        kernel_table(llm, prompts, temperature, graphs=args.graph_timeline)
    llm.shutdown()


def run_rounds(llm, args, temperature: float, steps: list, on_round) -> list[list[int]]:
    """A short warm-up, then the workload `args.rounds` times, each on a cleared prefix
    cache and `steps` list; `on_round(round, wall seconds, output tokens)` after each."""
    from pagellm import SamplingParams

    prompts, max_tokens = requests_of(args)
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in max_tokens
    ]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    for r in range(args.rounds):
        llm.reset_prefix_cache()
        steps.clear()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        on_round(r, time.perf_counter() - start, sum(max_tokens))
    return prompts


def async_timeline(args) -> None:
    from pagellm import LLM
    from pagellm.worker.model_runner import ModelRunner

    steps: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []
    queue_step = ModelRunner.execute_model_async

    def recorded(runner, scheduler_output, *grammar):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = queue_step(runner, scheduler_output, *grammar)
        end.record()
        tokens = scheduler_output.total_num_scheduled_tokens
        steps.append((tokens, len(scheduler_output.num_scheduled_tokens), start, end))
        return out

    def timeline(r: int, wall: float, out_tokens: int) -> None:
        torch.cuda.synchronize()
        spans = [s[2].elapsed_time(s[3]) for s in steps]  # ms
        gaps = [a[3].elapsed_time(b[2]) for a, b in zip(steps, steps[1:])]
        decode = [i for i, s in enumerate(steps[:-1]) if s[0] == s[1]]
        print(f"round {r}: {out_tokens / wall:.1f} out tok/s, wall {wall:.2f} s, "
              f"{len(steps)} steps: GPU spans {sum(spans) / 1e3:.2f} s, idle gaps "
              f"{sum(gaps) / 1e3:.2f} s")  # fmt: skip
        if decode:
            span = statistics.median(spans[i] for i in decode)
            gap = statistics.median(gaps[i] for i in decode)
            print(f"  decode-only steps: median span {span:.2f} ms, median gap after "
                  f"{gap:.3f} ms")  # fmt: skip

    ModelRunner.execute_model_async = recorded
    llm = LLM(model=args.model, load_format=args.load_format, max_num_seqs=256,
              **engine_kwargs(args))  # fmt: skip
    run_rounds(llm, args, 0.6, steps, timeline)
    llm.shutdown()


def report(r: int, wall: float, out_tokens: int, steps: list[tuple[int, int, float]]) -> None:
    mixed = [s for s in steps if s[0] > s[1]]  # more tokens than requests: prompt tokens in
    decode = [s for s in steps if s[0] == s[1]]
    print(f"round {r}: {out_tokens / wall:.1f} out tok/s, wall {wall:.2f} s, {len(steps)} steps "
          f"taking {sum(s[2] for s in steps):.2f} s")  # fmt: skip
    print(f"  steps with prompt tokens: {len(mixed)}, {sum(s[0] for s in mixed)} tokens, "
          f"{sum(s[2] for s in mixed):.2f} s")  # fmt: skip
    if decode:
        per_step = statistics.median(s[2] for s in decode) * 1e3
        print(f"  decode-only steps: {len(decode)}, {sum(s[2] for s in decode):.2f} s, "
              f"median {per_step:.2f} ms")  # fmt: skip
        batch = max(s[1] for s in decode)
        full = [s[2] for s in decode if s[1] == batch]
        print(f"  at the full batch ({batch}): {len(full)} steps, median "
              f"{statistics.median(full) * 1e3:.2f} ms")  # fmt: skip


def kernel_table(llm, prompts: list[list[int]], temperature: float, graphs: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from pagellm import SamplingParams

    engine = llm.llm_engine
    runner = engine.engine_core.engine_core.model_executor.model_runner
    if not graphs:
        runner.graphs = None  # eager: every kernel shows in the table
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": p}, params)
    while any(req.num_computed_tokens < req.num_prompt_tokens for req in _requests(engine)):
        engine.step()  # past the prefills
    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 5
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(runner.device)
    if graphs:
        graph_kernels(prof, steps)
    else:
        sort = "cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    engine.abort_request([f"profile-{i}" for i in range(len(prompts))])


def graph_kernels(prof, steps: int) -> None:
    """Per kernel name: device microseconds a step, launches a step; then the kernels' sum
    against the span from the first kernel's start to the last one's end."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        print("no device kernels recorded")
        return
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:70], []).append(e.time_range.elapsed_us())
    busy = sum(sum(d) for d in by_name.values())
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    # between kernels: next start - previous end; steps' host gaps (over 50 us) left out
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    inside = [g for g in gaps if g < 50]
    print(
        f"{len(kernels) / steps:.0f} kernels a step, device busy {busy / steps:.0f} us a "
        f"step of a {span / steps:.0f} us span; between kernels in a step: "
        f"{sum(inside) / steps:.0f} us a step, median {statistics.median(inside):.2f} us"
    )
    print(f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(durs) / steps:9.1f} {len(durs) / steps:10.1f} "
              f"{statistics.median(durs):8.2f}  {name}")  # fmt: skip


def _requests(engine):
    scheduler = engine.engine_core.engine_core.scheduler
    return list(scheduler.requests.values())


if __name__ == "__main__":
    main()
