"""CPU batch 1: the embedded model (SmolLM2-135M) as a GPTQ int4 checkpoint against its GGUF
path and llama.cpp on a Q4_0 GGUF of it, alternated in one run (issue 40).

    python benchmarks/cpu_int4.py                                  # GPTQ vs the GGUF path
    python benchmarks/cpu_int4.py --llama-cpp-python /opt/llama-venv/bin/python
    python benchmarks/cpu_int4.py --dtype bfloat16 --rounds 5
    python benchmarks/cpu_int4.py --int8-activations   # + GPTQ with x rounded to int8 blocks

(benchmarks/ leaves sys.path first: a script named like a package would shadow it.)
Prepared once in `--workdir` and kept:

    float32/   the embedded Q4_1 GGUF dequantized to float32, an HF folder with its tokenizer
               (`vllm_cpu_peer.py export`)
    gptq/      that folder packed as GPTQ int4, groups of 128, symmetric, v1 zeros, by
               `tests/wna16_pack.py` (GPTQ's format from its spec: min/max per group, fp16
               scales); the LM head, tied to the embeddings, stays float as GPTQ leaves it
    q4_0.gguf  the embedded file requantized to Q4_0 by llama.cpp's own quantizer
               (`llama_model_quantize`, its default Q4_0 mix: the 210 projections Q4_0, the
               tied embedding / LM head Q8_0 as in the Q4_1 file), with --llama-cpp-python

The workload is throughput.py's batch-1 CPU run: one request of 64 random token ids, 128
greedy tokens (ignore_eos), prefill included in output tok/s; `--rounds` rounds of A B (C),
medians (and each engine's best round: on a shared machine the rounds no other work slowed).
pagellm runs `LLM(model=gptq/)` (int4 groups read by the GGUF block kernel inside the C++
decoder loop) and `LLM()` (the embedded GGUF, the default); llama.cpp runs in its own venv
(llama-cpp-python; this script's `worker` mode in that interpreter) with torch's thread
count, one request at a time as throughput.py's `--peer llama.cpp` does. `--cpu-time` runs
pagellm in-process and adds each engine's process CPU seconds a run (tokens a CPU second: a
steadier measure than wall time where other work shares the cores; spinning threads count).
The last line is one JSON object with every number. No module-level torch import: the
worker's venv has none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_LEN, MAX_TOKENS = 64, 128


def _load(path: str, name: str):
    """A script of this repository by path (benchmarks/ is never put on sys.path)."""
    from pagellm.benchmarks.scripts import load_script

    return load_script(path, name)


def prepare(workdir: str) -> str:
    """The GPTQ folder (made from the embedded GGUF's float32 weights if not there yet)."""
    float_dir, gptq_dir = os.path.join(workdir, "float32"), os.path.join(workdir, "gptq")
    if not os.path.isfile(os.path.join(float_dir, "model.safetensors")):
        _load(os.path.join(HERE, "vllm_cpu_peer.py"), "cpu_int4_peer").export(float_dir)
    if not os.path.isfile(os.path.join(gptq_dir, "model.safetensors")):
        import shutil

        pack = _load(os.path.join(HERE, "..", "tests", "wna16_pack.py"), "cpu_int4_pack")
        shutil.copytree(float_dir, gptq_dir, dirs_exist_ok=True)
        packing = pack.Packing("gptq", bits=4, group=128, sym=True)
        pack.quantize_folder(gptq_dir, os.path.join(workdir, "gptq-dequantized"), packing)
    return gptq_dir


class LlamaCppWorker:
    """llama.cpp in its own interpreter: this script's `worker` mode, one line per round."""

    def __init__(self, python: str, gguf: str, threads: int) -> None:
        cmd = [python, os.path.abspath(__file__), "worker", gguf, str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the llama.cpp worker did not start")

    def __call__(self, prompts: list[list[int]]) -> tuple[float, float]:
        """(wall seconds, the worker's CPU seconds) of one run."""
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        wall, cpu = self.proc.stdout.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker(gguf: str, threads: int) -> None:
    """In llama-cpp-python's venv: load the file, then time each request list read from
    stdin (prefill, then MAX_TOKENS greedy tokens each, EOS not checked)."""
    from llama_cpp import Llama

    model = Llama(model_path=gguf, n_ctx=1024, n_batch=512, n_threads=threads,
                  n_threads_batch=threads, verbose=False)  # fmt: skip
    print("ready", flush=True)
    for line in sys.stdin:
        start, cpu = time.perf_counter(), time.process_time()
        for prompt in json.loads(line):
            for n, _ in enumerate(model.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
                if n == MAX_TOKENS:
                    break
        print(time.perf_counter() - start, time.process_time() - cpu, flush=True)


def quantize_q4_0(python: str, src: str, dst: str, threads: int) -> None:
    """`dst`: `src` requantized to Q4_0 by llama.cpp (llama_model_quantize), once."""
    if os.path.isfile(dst):
        return
    code = (
        "import ctypes, sys, llama_cpp as l\n"
        "p = l.llama_model_quantize_default_params()\n"
        "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_0; p.allow_requantize = True\n"
        f"p.nthread = {threads}\n"
        "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
        "ctypes.byref(p)))\n"
    )
    subprocess.run([python, "-c", code, src, dst], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/pagellm-cpu-int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="pagellm's (bfloat16 too)")
    ap.add_argument("--llama-cpp-python", default=None, help="an interpreter with llama_cpp")
    ap.add_argument(
        "--int8-activations",
        action="store_true",
        help="a third pagellm engine: GPTQ with PAGELLM_CPU_INT8_ACTIVATIONS=1",
    )
    ap.add_argument("--cpu-time", action="store_true",
                    help="pagellm in-process; each engine's CPU seconds too")  # fmt: skip
    args = ap.parse_args()
    if args.cpu_time:  # the EngineCore in this process: its CPU time is this process's
        os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"
    import torch

    from pagellm import LLM
    from pagellm.loader import resolve_model_source

    throughput = _load(os.path.join(HERE, "throughput.py"), "cpu_int4_throughput")
    gptq_dir = prepare(args.workdir)
    prompts = throughput.make_requests(1, PROMPT_LEN, PROMPT_LEN, seed=0)
    engines = {
        "pagellm-gptq": LLM(model=gptq_dir, dtype=args.dtype, max_num_seqs=1),
        "pagellm-gguf": LLM(dtype=args.dtype, max_num_seqs=1),
    }
    if args.int8_activations:  # read where the engine loads its weights
        os.environ["PAGELLM_CPU_INT8_ACTIVATIONS"] = "1"
        engines["pagellm-gptq-int8x"] = LLM(model=gptq_dir, dtype=args.dtype, max_num_seqs=1)
        del os.environ["PAGELLM_CPU_INT8_ACTIVATIONS"]
    runners = {n: _timed(throughput.run_pagellm, e) for n, e in engines.items()}
    cpp = None
    if args.llama_cpp_python:
        q4_0 = os.path.join(args.workdir, "q4_0.gguf")
        threads = torch.get_num_threads()
        quantize_q4_0(args.llama_cpp_python, resolve_model_source(None).path, q4_0, threads)
        runners["llama.cpp-q4_0"] = cpp = LlamaCppWorker(args.llama_cpp_python, q4_0, threads)
    times, cpu = alternate(runners, prompts, args.rounds)
    tok_s = {n: round(MAX_TOKENS / statistics.median(t), 1) for n, t in times.items()}
    result = {
        "bench": "cpu_int4", "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
        "threads": torch.get_num_threads(), "workload": f"1 x {PROMPT_LEN} prompt, {MAX_TOKENS} "
        "greedy tokens", "quantization": {n: e.llm_engine.config.model_config.quantization
                                           for n, e in engines.items()},
        "output_tok_s": tok_s, "runs_s": {n: [round(x, 3) for x in t] for n, t in times.items()},
        "best_round_tok_s": {n: round(MAX_TOKENS / min(t), 1) for n, t in times.items()},
    }  # fmt: skip
    if args.cpu_time:  # tokens a CPU second: steadier than wall time on a shared machine
        tok_s = {n: round(MAX_TOKENS / statistics.median(t), 1) for n, t in cpu.items()}
        result.update(output_tok_per_cpu_s=tok_s, cpu_s={n: [round(x, 3) for x in t]
                                                           for n, t in cpu.items()})  # fmt: skip
    for name in tok_s:
        if name != "pagellm-gptq":
            result[f"gptq_over_{name}"] = round(tok_s["pagellm-gptq"] / tok_s[name], 3)
    for engine in engines.values():
        engine.shutdown()
    if cpp is not None:
        cpp.close()
    print(json.dumps(result))


def _timed(run_pagellm, engine):
    """A runner of one pagellm engine: (wall seconds, this process's CPU seconds)."""

    def run(prompts: list[list[int]]) -> tuple[float, float]:
        cpu = time.process_time()
        wall = run_pagellm(engine, prompts, MAX_TOKENS)
        return wall, time.process_time() - cpu

    return run


def alternate(runners: dict, prompts: list[list[int]], rounds: int) -> tuple[dict, dict]:
    """A warm-up each, then `rounds` rounds of A B (C): wall and CPU seconds of each run."""
    for run in runners.values():
        run(prompts)
    times: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, run in runners.items():
            wall, cpu_s = run(prompts)
            times[name].append(wall)
            cpu[name].append(cpu_s)
            print(f"round {r}: {name:16s} {MAX_TOKENS / wall:7.1f} output tok/s "
                  f"({cpu_s:.2f} CPU s)", flush=True)  # fmt: skip
    return times, cpu


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # see -P above
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
