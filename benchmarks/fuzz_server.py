"""Fuzz `pagellm serve` with schemathesis against its own /openapi.json, every check on.

    python benchmarks/fuzz_server.py --max-examples 500        # starts a server itself
    python benchmarks/fuzz_server.py --url http://127.0.0.1:8000 --api-key KEY

It runs `st run --checks all` (positive and negative data: schemathesis makes requests that fit
the schema and requests that break it) and prints one JSON line: test cases, server errors (5xx),
failures per check. The target is 0 and 0.

Schemathesis also loads this file as its hooks module (SCHEMATHESIS_HOOKS). The hooks keep a
valid request cheap to serve on a CPU (max_tokens and min_tokens at most 4, n at most 2, at most
3 prompts), without touching requests that break the schema. The server answers a request that
fits the schema but not this model (a prompt longer than the context, a token id outside the
vocabulary, a regex that does not compile) with a 400 that says so, so 400s are expected for
positive data (the only built-in check this script configures); a check of our own,
`schema_valid_requests_are_served`, fails any other 400 a schema-valid request gets: a limit
the server enforces and its OpenAPI document does not state.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

_CAPS = {
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "max_output_tokens": 4,
    "min_tokens": 4,
    "n": 2,
}
_MAX_PROMPTS = 3
_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404", "429"]
"""


# why a schema-valid request may still be refused: what no OpenAPI document can state
_UNSTATABLE = re.compile(
    "|".join(
        (
            r"maximum context length",  # the prompt's tokens and max_tokens against the context
            r"maximum model length",  # a pooling input (or truncate_prompt_tokens) over it
            r"prompt is empty",  # a text the tokenizer encodes to no tokens (no specials)
            r"special tokens \(\d+\)",  # truncate_prompt_tokens below the tokenizer's specials
            r"is a pooling model|is an embedding model|is a classification model",  # endpoint
            r"Matryoshka|supports dimensions|^dimensions",  # dimensions against the model's
            r"score pairs one text with many",  # text_1 / text_2 lengths: 1 to N or N to N
            r"min_tokens must be less than or equal to max_tokens",  # two fields' relation
            r"^LoRA adapter|cannot name a LoRA adapter",  # the folder's contents, taken names
            r"output constraint allows no token",  # a grammar and allowed_token_ids disjoint
            r"out of vocabulary|outside any vocabulary",  # logit_bias's keys (strings) as ids
            r"chat template",  # the model's template refusing the messages
            r"^invalid (regex|grammar|JSON schema)",  # a constraint xgrammar cannot compile
            r"^the (regex|grammar|JSON schema)|^a pattern",  # ... or one over a limit of its cost
            r"StructuredOutputsParams\.json (is not valid JSON|nests)",  # JSON text in a string
            r"arguments must be JSON",  # a function_call item's arguments (JSON text in a string)
            r"only one output constraint",  # fields that exclude one another
            r"^tool_choice|^tools",  # a tool_choice naming a function not in tools
            r"^best_of",  # best_of above n
            r"priority needs",  # a priority without --scheduling-policy priority
            r"more than this server queues",  # n x prompts beyond the queue
            r"cannot pass on",  # an integer beyond 64 bits deep in a message's free-form fields
        )
    )
)


def _cap(body: dict) -> dict:
    """A valid body made cheap: numbers over the caps lowered, prompt lists shortened, and no
    chat reply left to fill the context."""
    if "input" in body:  # /v1/responses
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = _CAPS["max_output_tokens"]
    elif "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = _CAPS["max_tokens"]
    for name, cap in _CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:_MAX_PROMPTS]
    return body


def _register_hooks() -> None:
    import schemathesis

    @schemathesis.hook
    def map_case(context, case):
        if _positive(case) and isinstance(case.body, dict):
            case.body = _cap(case.body)
        return case

    @schemathesis.check
    def schema_valid_requests_are_served(ctx, response, case):
        """A request that fits the schema gets 2xx, or a 400 for what no document can state."""
        if not _positive(case) or response.status_code != 400:
            return None
        message = str((response.json().get("error") or {}).get("message"))
        if not _UNSTATABLE.search(message):
            raise AssertionError(f"a schema-valid request was refused: {message[:300]}")
        return None


def _positive(case) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode.is_positive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(api_key: str, max_model_len: int) -> list[str]:
    """The `pagellm serve` flags of a fuzzed server (tests/test_server_fuzz.py uses them too)."""
    return ["--api-key", api_key, "--max-model-len", str(max_model_len), "--max-num-seqs", "16"]


def _start_server(args: argparse.Namespace, log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm", "serve", "--port", str(port)]
    cmd += [*server_flags(args.api_key, args.max_model_len), *args.server_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log_path}")


def run_schemathesis(
    url: str, api_key: str, workdir: str, max_examples: int, workers: int = 1, seed: int = 0
) -> dict:
    """`st run --checks all` against a server, with these hooks; its summary (`_summarize`)."""
    config = os.path.join(workdir, "schemathesis.toml")
    with open(config, "w") as f:
        f.write(_CONFIG)
    report = os.path.join(workdir, "events.ndjson")
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or "st"
    cmd = [st, "--config-file", config, "run", f"{url}/openapi.json", "--checks", "all"]
    cmd += ["--max-examples", str(max_examples), "--workers", str(workers)]
    cmd += ["-H", f"Authorization: Bearer {api_key}", "--seed", str(seed)]
    cmd += ["--request-timeout", "300", "--max-response-time", "300"]
    cmd += ["--report", "ndjson", "--report-ndjson-path", report]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": os.path.abspath(__file__)}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True)  # its cache
    print(done.stdout[-6000:], file=sys.stderr)
    summary = _summarize(report)
    summary.update(exit_code=done.returncode, seconds=round(time.perf_counter() - start, 1))
    return summary


def _summarize(ndjson_path: str) -> dict:
    """Cases, 5xx responses and failures per check, from schemathesis' event stream."""
    cases, server_errors, failures = 0, 0, {}
    with open(ndjson_path) as f:
        for line in f:
            event = json.loads(line)
            for key, value in event.items():
                if key == "ScenarioFinished":
                    recorder = value.get("recorder", {})
                    cases += len(recorder.get("cases", {}))
                    for interactions in recorder.get("interactions", {}).values():
                        status = (interactions.get("response") or {}).get("status_code", 0)
                        server_errors += status >= 500
                    for checks in recorder.get("checks", {}).values():
                        for check in checks:
                            if str(check.get("status")).lower() == "failure":
                                name = check.get("name", "?")
                                failures[name] = failures.get(name, 0) + 1
    return {"cases": cases, "server_errors": server_errors, "failures": failures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="fuzz a running server (else one is started)")
    p.add_argument("--api-key", default="fuzz-key")
    p.add_argument("--max-examples", type=int, default=200, help="per API operation")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=64, help="bounds every generation")
    p.add_argument("server_args", nargs="*", help="more `pagellm serve` flags (after --)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="pagellm-fuzz-")
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_server(args, os.path.join(workdir, "server.log"))
    try:
        summary = run_schemathesis(
            url, args.api_key, workdir, args.max_examples, args.workers, args.seed
        )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    summary["server_log"] = None if proc is None else os.path.join(workdir, "server.log")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
elif "SCHEMATHESIS_HOOKS" in os.environ:  # loaded by schemathesis as its hooks module
    _register_hooks()
