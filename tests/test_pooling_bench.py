"""benchmarks/pooling.py runs: 20 short passages through a one-layer BERT, pagellm against
sentence-transformers, one JSON line with both rates and embeddings that agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pooling_benchmark_smoke():
    args = ["--shape", "tiny", "--num-passages", "20", "--min-tokens", "8", "--max-tokens",
            "40", "--tune-passages", "8", "--batch-sizes", "8", "16", "--rounds", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pooling.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["passages"] == 20 and result["peer"] == "sentence-transformers"
    assert 8 <= result["min_tokens"] and result["max_tokens"] <= 40
    assert result["peer_batch_size"] in (8, 16)
    assert result["pagellm_pps"][0] > 0 and result["peer_pps"][0] > 0 and result["ratio"] > 0
    assert len(result["load_pagellm"]) == len(result["load_peer"]) == 1
    assert result["max_abs_diff"] < 1e-5  # the same embeddings from both


def test_embed_serve_benchmark_smoke():
    """benchmarks/embed_serve.py on the CPU: a one-layer BERT served, /v1/embeddings loaded by
    the in-process client, one JSON line with the rate (no peer here)."""
    args = ["--shape", "tiny", "--device", "cpu", "--num-prompts", "24", "--concurrency", "4",
            "--input-len", "16", "--rounds", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embed_serve.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {"pagellm": 0} and result["requests_per_s"]["pagellm"][0] > 0
    assert result["e2el_ms_p50"]["pagellm"][0] > 0 and "ratio" not in result
