"""The `pagellm` command line: parsers, `generate` and `chat` as real subprocesses.

`pagellm serve` and `pagellm bench serve` are exercised by tests/test_server.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from timing import scaled

from pagellm import CompletionOutput, RequestOutput, SamplingParams
from pagellm.cli import build_parser, engine_args_from, main, sampling_params_from
from pagellm.entrypoints import chat_cli

SMALL = ["--max-model-len", "256", "--dtype", "float32"]


def _pagellm() -> list[str]:
    """The installed console script, or `python -m pagellm` where there is none."""
    script = os.path.join(os.path.dirname(sys.executable), "pagellm")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "pagellm"]


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        _pagellm() + args, input=stdin, capture_output=True, text=True, timeout=scaled(300)
    )


def test_help_lists_the_subcommands():
    out = _run(["--help"])
    assert out.returncode == 0
    assert all(cmd in out.stdout for cmd in ("generate", "serve", "chat", "bench"))


def test_serve_flags_are_the_engine_args():
    ns = build_parser().parse_args(
        ["serve", "some/model", "--port", "9000", "--max-model-len", "512", "--api-key", "k"]
    )
    assert (ns.model_tag, ns.port, ns.api_key, ns.host) == ("some/model", 9000, "k", "127.0.0.1")
    ns.model = ns.model_tag
    args = engine_args_from(ns)
    assert (args.model, args.max_model_len, args.served_model_name) == ("some/model", 512, None)
    ns = build_parser().parse_args(["serve", "--served-model-name", "smol"])
    assert engine_args_from(ns).served_model_name == "smol" and ns.model_tag is None


def test_serve_takes_every_tool_call_parser():
    """gpt-oss's `--tool-call-parser openai` (as vLLM users pass it) is one of the server's
    parsers: argparse must not refuse it."""
    from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    for name in TOOL_PARSERS:
        args = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", name]
        args += ["--reasoning-parser", "openai_gptoss"]
        assert build_parser().parse_args(args).tool_call_parser == name


def test_bench_serve_flags():
    ns = build_parser().parse_args(["bench", "serve", "--num-prompts", "3", "--concurrency", "2"])
    assert (ns.num_prompts, ns.concurrency, ns.url) == (3, 2, "http://127.0.0.1:8000")


@pytest.mark.slow
def test_generate_prints_a_throughput_line():
    out = _run(["generate", "The capital of France is", "--max-tokens", "4", *SMALL])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--- 'The capital of France is'" in out.stdout
    assert "output tok/s" in out.stdout.splitlines()[-1]


@pytest.mark.slow
def test_chat_streams_replies_and_quits():
    stdin = "My name is Ada.\nWhat is my name?\n/exit\n"
    out = _run(["chat", "--max-tokens", "8", "--temperature", "0", *SMALL], stdin)
    assert out.returncode == 0, out.stderr[-2000:]
    replies = out.stdout.split("> ")[1:]
    assert len(replies) == 3 and replies[0].strip() and replies[1].strip()
    assert replies[2] == ""  # the prompt that read /exit


class FakeEngine:
    """Records the prompts it is given; replies "reply N" in two DELTA pieces."""

    def __init__(self) -> None:
        self.prompts: list[list[dict]] = []
        self.pending: list[str] = []

    def get_tokenizer(self) -> FakeEngine:
        return self

    special_tokens_map: dict = {}

    def get_chat_template(self, chat_template: str | None, tools: list | None) -> str:
        return "{{ messages | tojson }}"  # the prompt is the conversation, as JSON

    def add_request(self, request_id: str, prompt: str, params: object) -> None:
        self.prompts.append(json.loads(prompt))
        self.pending = ["reply ", str(len(self.prompts))]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        text = self.pending.pop(0)
        return [RequestOutput("r", None, [], [CompletionOutput(0, text, [], None, None)], True)]


def test_chat_keeps_the_conversation(monkeypatch, capsys):
    lines = iter(["hi", "", "again", "/reset", "new", "/exit"])
    monkeypatch.setattr(chat_cli, "_read_line", lambda: next(lines))
    engine = FakeEngine()
    chat_cli._loop(engine, SamplingParams(), system="be brief")
    system = {"role": "system", "content": "be brief"}
    assert engine.prompts == [
        [system, {"role": "user", "content": "hi"}],
        [
            system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "reply 1"},
            {"role": "user", "content": "again"},
        ],
        [system, {"role": "user", "content": "new"}],
    ]
    assert capsys.readouterr().out == "reply 1\nreply 2\nreply 3\n"


def test_generate_sampling_flags_are_the_sampling_params_fields():
    args = ["generate", "x", "--stop", "a", "--stop", "b", "--top-k", "5", "--min-p", "0.1",
            "--sampling-seed", "3", "--ignore-eos", "--no-skip-special-tokens",
            "--stop-token-ids", "7", "--bad-words", "foo", "--logprobs", "2"]  # fmt: skip
    params = sampling_params_from(build_parser().parse_args(args))
    assert params.stop == ["a", "b"] and params.stop_token_ids == [7] and params.top_k == 5
    assert (params.min_p, params.seed, params.logprobs) == (0.1, 3, 2)
    assert params.ignore_eos and not params.skip_special_tokens and params.bad_words == ["foo"]
    assert (params.max_tokens, params.temperature) == (64, 0.0)  # generate's own defaults
    ns = build_parser().parse_args(["generate"])
    assert ns.seed == 0 and ns.sampling_seed is None  # --seed stays the engine's
    flagged = {n for n in SamplingParams.__struct_fields__ if hasattr(ns, n)} | {"seed"}
    not_flags = {"logit_bias", "output_kind", "structured_outputs", "bad_words_token_ids"}
    not_flags |= {"reasoning_tag_ids"}
    assert flagged == set(SamplingParams.__struct_fields__) - not_flags


def test_generate_bad_sampling_flag_is_a_clear_error(capsys):
    assert main(["generate", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
