"""schemathesis against `pagellm serve`, at small size: every check, schemathesis' own and
benchmarks/fuzz_server.py's `schema_valid_requests_are_served` (a request that fits the OpenAPI
document is served, or refused only for what no document can state, such as a prompt longer
than the context), must pass, with no server error.

The server runs a tiny random Llama with the embedded model's tokenizer, so that the ~1000
requests of the run cost milliseconds each; the document is the same as the real model's but
for its vocabulary size."""

from __future__ import annotations

import pytest
from benchmark_modules import load
from server_utils import API_KEY, start_server, stop_server, wait_healthy

MAX_EXAMPLES = 10  # per operation, after the coverage phase's deterministic cases


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    flags = load("fuzz_server").server_flags(API_KEY, max_model_len=64)
    srv = start_server([tiny_chat_model, *flags], str(tmp_path_factory.mktemp("fuzz") / "log"))
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


def test_schemathesis_finds_nothing(server, tmp_path):
    summary = load("fuzz_server").run_schemathesis(server.url, API_KEY, str(tmp_path), MAX_EXAMPLES)
    assert summary["cases"] >= 500, summary
    assert summary["server_errors"] == 0 and summary["failures"] == {}, summary
    assert summary["exit_code"] == 0, summary
