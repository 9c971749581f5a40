"""benchmarks/spec_decode.py in its smallest mode: one grounded prompt, off vs ngram, each in a
process of its own as the benchmark runs them, on the embedded model in float32. What the
figures rest on is checked: the same greedy tokens with and without drafts, drafts accepted on
an input-grounded answer, the core's counters equal to the requests' own metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import benchmark_modules
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec_bench") / "result.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "spec_decode.py"), "--set",
           "grounded", "--prompts-per-set", "1", "--max-tokens", "40", "--rounds", "1",
           "--methods", "ngram", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["rows"]  # the last line is JSON
    return json.loads(out.read_text())


def rows_by_method(result) -> dict[str, dict]:
    return {r["method"]: r for r in result["rows"] if r["engine"] == "pagellm"}


@pytest.mark.slow
def test_outputs_equal_speculation_off(result):
    rows = rows_by_method(result)
    assert set(rows) == {"off", "ngram"}
    assert rows["ngram"]["compared"] == 1
    assert rows["ngram"]["mismatches"] == 0, rows["ngram"]["mismatch_at"]
    assert rows["off"]["tokens"] == rows["ngram"]["tokens"] > 0


@pytest.mark.slow
def test_drafts_accepted_and_counted(result):
    ngram = rows_by_method(result)["ngram"]
    assert ngram["error"] is None
    assert ngram["drafts"] > 0 and ngram["drafted"] >= ngram["drafts"]
    assert 0 < ngram["accepted"] <= ngram["drafted"]
    assert ngram["accept_len"] == pytest.approx(1 + ngram["accepted"] / ngram["drafts"])
    assert ngram["tokens_per_step"] > 1
    # the core's SchedulerStats and the requests' RequestOutput.metrics agree
    assert ngram["request_metrics_drafted_accepted"] == [ngram["drafted"], ngram["accepted"]]
    assert "accept_len" not in rows_by_method(result)["off"]


@pytest.mark.slow
def test_figures_and_load_recorded(result):
    for row in result["rows"]:
        assert row["tok_s"] > 0 and row["seconds"] > 0
        assert len(row["load"]) == len(row["others"]) == 1 and row["others"][0] >= 0
    ngram = rows_by_method(result)["ngram"]
    assert ngram["x_off"] == pytest.approx(ngram["tok_s"] / rows_by_method(result)["off"]["tok_s"])


def test_lookup_tokens_per_step():
    prompts = benchmark_modules.load("spec_decode_prompts")
    text = [5, 6, 7, 8, 9, 10, 11]
    # the answer copies the prompt: no match for its first two tokens, then 3 drafts kept
    # and the step's own token: steps [5], [6], [7 8 9 | 10], [11]
    per_step = prompts.lookup_tokens_per_step(text, [5, 6, 7, 8, 9, 10, 11], k=3, lo=2, hi=3)
    assert per_step == pytest.approx(7 / 4)
    assert prompts.lookup_tokens_per_step(text, [1, 2, 3, 4], k=3, lo=2, hi=3) == 1.0
