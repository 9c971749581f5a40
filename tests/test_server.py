"""The OpenAI-compatible server, as a real subprocess on loopback, talked to by real clients.

One server (`pagellm serve`, the embedded model, float32; conftest's `api_server`, shared with
test_server_robustness.py) serves the module: the official `openai` package (sync and async,
streaming and not), raw httpx for errors and disconnects.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_utils import API_KEY, AUTH, Server
from server_utils import error_of as _error
from server_utils import metrics as _metrics
from server_utils import post as _post
from server_utils import wait_kv_free as _wait_kv_free
from timing import scaled

from pagellm import SamplingParams

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def server(api_server) -> Server:
    return api_server


@pytest.fixture(scope="module")
def client(api_client):
    return api_client


# ---- open endpoints and the openai client ----------------------------------------------------


MAX_TOKENS = 5
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def reference(llm) -> dict[str, str]:
    """Greedy texts from the in-process engine, one batch: prompt (or "chat") -> text."""
    chat_prompt = llm.get_tokenizer().apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    prompts = PROMPTS[:3] + [chat_prompt]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    texts = {p: o.outputs[0].text for p, o in zip(prompts, outputs)}
    texts["chat"] = texts.pop(chat_prompt)
    return texts


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
INCLUDE_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def test_health_version_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completions_equal_llm_generate(client, llm, reference):
    prompts = PROMPTS[:3]
    out = client.completions.create(model=MODEL, prompt=prompts, logprobs=0, **GREEDY)
    assert out.object == "text_completion"
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [reference[p] for p in prompts]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert all("".join(c.logprobs.tokens) == c.text for c in out.choices)
    tokenizer = llm.get_tokenizer()
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 3 * MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_stream_equals_llm_generate(client, reference):
    prompt = PROMPTS[0]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, **GREEDY, **INCLUDE_USAGE))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == reference[prompt]
    assert [c.finish_reason for c in choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_token_id_prompts_and_echo(client, llm, reference):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], echo=True, **GREEDY)
    assert out.choices[0].text == PROMPTS[1] + reference[PROMPTS[1]]
    assert out.usage.prompt_tokens == len(ids) + 3


def test_echo_with_logprobs_scores_the_prompt(client, llm):
    """`echo` + `logprobs`: the prompt's tokens carry their logprobs (the first: null), the
    engine's prompt_logprobs, in the response and in the first streamed chunk."""
    ids = llm.get_tokenizer().encode(PROMPTS[3])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    want = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].prompt_logprobs
    expected = [None] + [entry[t].logprob for entry, t in zip(want[1:], ids[1:])]
    request = dict(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0)
    out = client.completions.create(**request).choices[0].logprobs
    chunk = next(iter(client.completions.create(**request, stream=True))).choices[0].logprobs
    for got in (out, chunk):
        prompt_part = got.token_logprobs[: len(ids)]
        assert prompt_part[0] is None and got.top_logprobs[0] is None
        assert prompt_part[1:] == pytest.approx(expected[1:], abs=1e-4)
        assert all(len(top) >= 2 for top in got.top_logprobs[1 : len(ids)])
    assert len(out.token_logprobs) == len(ids) + 1  # and the generated token


def test_truncate_prompt_tokens(client):
    """vLLM's extra field: the last k prompt tokens, even of a prompt past the context."""
    long = [7] * 1100  # the context is 1024
    body = {"truncate_prompt_tokens": 10, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body=body)
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 2


def test_chat_sync_and_stream(client, reference):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    message = out.choices[0].message
    assert (message.role, message.content) == ("assistant", reference["chat"])
    assert out.object == "chat.completion" and out.usage.completion_tokens == MAX_TOKENS
    greedy = {**GREEDY, "max_completion_tokens": MAX_TOKENS, "max_tokens": None}
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy, **INCLUDE_USAGE)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    usage = chunks[-1].usage
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == out.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix hit


def test_n_times_prompts_choices(client):
    out = client.completions.create(
        model=MODEL, prompt=["One", "Two"], n=2, max_tokens=2, seed=1, temperature=1.0
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert 4 <= out.usage.completion_tokens <= 8  # each choice: 1 or 2 tokens


async def _checked_stream(c: openai.AsyncOpenAI, i: int, tokenizer) -> None:
    """One streamed completion; its chunks must be complete and in order."""
    prompt = f"{PROMPTS[i % len(PROMPTS)]} (request {i})"
    stream = await c.completions.create(
        model=MODEL, prompt=prompt, logprobs=0, **GREEDY, **INCLUDE_USAGE
    )
    tokens, offsets, finish, usage = [], [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
            finish.append(choice.finish_reason)
    assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage.completion_tokens == len(tokens) == MAX_TOKENS
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    # each chunk's offsets continue the last one's: nothing lost, nothing out of order
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(MAX_TOKENS)]


async def _async_chat_and_completion(c: openai.AsyncOpenAI) -> None:
    out = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert out.choices[0].text is not None
    stream = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True)
    finish = [ch.choices[0].finish_reason async for ch in stream if ch.choices]
    assert finish[-1] in ("stop", "length")


def test_32_concurrent_streams_and_async_client(server, llm):
    tokenizer = llm.get_tokenizer()

    async def run() -> None:
        url = f"{server.url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
            streams = [_checked_stream(c, i, tokenizer) for i in range(32)]
            await asyncio.gather(*streams)
            await _async_chat_and_completion(
                c
            )  # alone: logprobs and no-logprobs requests must not share a batch yet

    asyncio.run(run())


# ---- disconnects free the KV cache ----------------------------------------------------------


def _long_request(stream: bool) -> dict:
    return {
        "prompt": "Tell me a long story.",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": stream,
    }


def test_disconnect_mid_stream_frees_kv_blocks(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=_long_request(True)) as r:
            assert r.status_code == 200
            num_chunks = 0
            for line in r.iter_lines():  # leaving this loop closes the connection
                num_chunks += line.startswith("data:")
                if num_chunks == 3:
                    assert _metrics(server)["pagellm:kv_cache_usage_perc"] > 0
                    break
    _wait_kv_free(server)


def test_disconnect_while_waiting_for_non_streamed_response_frees_kv_blocks(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/v1/completions", headers=AUTH, json=_long_request(False), timeout=1.5
        )
    _wait_kv_free(server)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "x", "temperature": -1}, ["temperature"]),
        ({"prompt": "hello " * 1100, "max_tokens": 4}, ["1024"]),
        ({"prompt": "x", "max_tokens": 2000}, ["1024"]),
        ("{not json", ["JSON"]),
        ({"prompt": "x", "max_tokens": "many"}, ["max_tokens"]),
        ({"max_tokens": 3}, ["prompt"]),
        ({"prompt": [10**9]}, ["vocab"]),
        ({"prompt": "x", "suffix": "y"}, ["suffix", "not supported"]),
        ({"prompt": "x", "best_of": 3}, ["best_of"]),
        ({"prompt": "x", "response_format": {"type": "xml"}}, ["response_format"]),
        ({"prompt": "x", "guided_decoding_backend": "outlines"}, ["guided_decoding_backend"]),
        ({"prompt": "x", "guided_regex": "([a-z"}, ["regex", "not closed", "position 6"]),
        ({"prompt": "x", "guided_json": {"type": "nonsense"}}, ["JSON schema", "type"]),
        ({"prompt": "x", "guided_json": {}, "guided_regex": "a"}, ["guided_json", "guided_regex"]),
        ({"prompt": "x", "priority": 3}, ["priority", "scheduling-policy"]),
        ({"prompt": "x", "logit_bias": {"-5": 1}}, ["logit_bias", "vocab"]),
        ({"prompt": "x", "n": 10**6}, ["n"]),  # would block the server while fanning out
        ({"prompt": ["x"] * 2049}, ["prompt"]),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, ["stream_options", "stream"]),
    ],
)
def test_bad_completion_requests_are_400(server, body, words):
    error = _error(_post(server, "/v1/completions", body), 400)
    assert all(w in error["message"] for w in words), error


def test_bad_chat_requests_are_400(server):
    too_long = {"messages": [{"role": "user", "content": "a " * 1100}]}
    assert "1024" in _error(_post(server, "/v1/chat/completions", too_long), 400)["message"]
    _error(_post(server, "/v1/chat/completions", {"messages": []}), 400)
    _error(_post(server, "/v1/chat/completions", {"messages": "hi"}), 400)
    tools = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    assert "tools" in _error(_post(server, "/v1/chat/completions", tools), 400)["message"]
    usage = {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}}
    error = _error(_post(server, "/v1/chat/completions", usage), 400)
    assert "stream_options is only allowed when stream is true" in error["message"]


def test_tokenize_and_detokenize(server, llm):
    tokenizer = llm.get_tokenizer()
    got = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert got["tokens"] == tokenizer.encode(PROMPTS[0]) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 1024
    chat_text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat = _post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.encode(chat_text, add_special_tokens=False)
    text = _post(server, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(got["tokens"])
    _error(_post(server, "/tokenize", {"prompt": "x", "messages": CHAT}), 400)
    assert "vocab" in _error(_post(server, "/detokenize", {"tokens": [10**9]}), 400)["message"]


def test_api_key_is_required_on_v1_and_tokenization(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        error = _error(_post(server, "/v1/completions", {"prompt": "x"}, headers), 401)
        assert "API key" in error["message"]
        _error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
        _error(_post(server, "/tokenize", {"prompt": "x"}, headers), 401)
        _error(_post(server, "/detokenize", {"tokens": [1]}, headers), 401)
    for path in ("/metrics", "/health", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_model_is_404(server, client):
    error = _error(_post(server, "/v1/completions", {"prompt": "x", "model": "gpt-5"}), 404)
    assert "gpt-5" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    pooling = {"/v1/embeddings": {"input": "x"}, "/classify": {"input": "x"}}
    pooling["/rerank"] = {"query": "q", "documents": ["d"]}
    for path, body in pooling.items():
        error = _error(_post(server, path, body), 404)  # a generative model serves no pooling
        assert "is a generative model" in error["message"]


def test_metrics_names(server):
    metrics = _metrics(server)
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
    counters = ["prompt_tokens_total", "generation_tokens_total", "num_preemptions_total"]
    counters += ["prefix_cache_queries_total", "prefix_cache_hits_total"]
    histograms = ["time_to_first_token", "inter_token_latency", "e2e_request_latency"]
    names = gauges + counters + [f"{h}_seconds_count" for h in histograms]
    assert [n for n in names if f"pagellm:{n}" not in metrics] == []
    assert metrics["pagellm:generation_tokens_total"] > 0


def test_prefix_cache_counters_and_the_stats_line(server, client):
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens: " + "abc " * 40
    before = _metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = _metrics(server)
    queries = (
        after["pagellm:prefix_cache_queries_total"] - before["pagellm:prefix_cache_queries_total"]
    )
    hits = after["pagellm:prefix_cache_hits_total"] - before["pagellm:prefix_cache_hits_total"]
    assert hits >= 48 and queries >= hits + 48  # the second request found the first's blocks
    stats_lines = [line for line in server.log().splitlines() if "Avg prompt throughput" in line]
    assert stats_lines and "KV cache usage" in stats_lines[-1]


# ---- the load generator ---------------------------------------------------------------------


def test_bench_serve(server):
    cmd = [sys.executable, "-m", "pagellm", "bench", "serve", "--url", server.url]
    cmd += ["--num-prompts", "4", "--concurrency", "4", "--input-len", "8", "--output-len", "3"]
    out = subprocess.run(
        cmd + ["--api-key", API_KEY], capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_throughput"] > 0 and summary["ttft_ms_p50"] > 0
    assert "TTFT" in out.stdout


# ---- structured outputs, tools, extras -------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Give me a person as JSON."}]
STRUCTURED = {"model": MODEL, "temperature": 0.0, "max_tokens": 64}


def test_parse_with_a_pydantic_model(client):
    import pydantic

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    out = client.chat.completions.parse(messages=ASK, response_format=Person, **STRUCTURED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)


def test_json_schema_streamed_and_not(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = client.chat.completions.create(messages=ASK, response_format=fmt, **STRUCTURED)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    chunks = client.chat.completions.create(
        messages=ASK, response_format=fmt, stream=True, **STRUCTURED
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    done = client.completions.create(
        prompt="A JSON object:", extra_body={"response_format": {"type": "json_object"}},
        **STRUCTURED,
    )  # fmt: skip
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_guided_fields_constrain(client):
    import jsonschema

    out = client.completions.create(
        prompt="Person:", extra_body={"guided_json": PERSON}, **STRUCTURED
    )
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    regex = client.completions.create(
        prompt="Code:", extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"}, **STRUCTURED
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", regex.choices[0].text)
    choice = client.chat.completions.create(
        messages=ASK, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **STRUCTURED
    )
    assert choice.choices[0].message.content in ("yes", "no")


def test_bad_words_never_appear(client, llm):
    free = client.completions.create(prompt=PROMPTS[3], max_tokens=16, temperature=0.0, model=MODEL)
    words = [w.strip(".,:") for w in free.choices[0].text.split() if len(w.strip(".,:")) > 3][:2]
    assert words
    out = client.completions.create(
        prompt=PROMPTS[3], max_tokens=16, temperature=0.0, model=MODEL,
        extra_body={"bad_words": words},
    )  # fmt: skip
    from pagellm.engine.input_processor import bad_words_token_ids

    ids = llm.get_tokenizer().encode(out.choices[0].text, add_special_tokens=False)
    for seq in bad_words_token_ids(llm.get_tokenizer(), words):
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids))), (seq, words)


def _streamed_call(client, **kwargs) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                assert call["name"] is None and call["arguments"] == ""  # the name comes first
                call["name"] = d.function.name
            call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_tool_conversation(client):
    """Turn 1: tool_choice "required"; turn 2, after the tool's result: a named function.
    Each call parses and validates, and its streamed deltas reassemble to it."""
    import jsonschema

    tools = [WEATHER_TOOL, TIME_TOOL]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kwargs = {"messages": messages, "tools": tools, "tool_choice": "required", **STRUCTURED}
    first = client.chat.completions.create(**kwargs)
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls
    assert calls and all(c.function.name in schemas for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed, finish = _streamed_call(client, **kwargs)
    assert finish == "tool_calls"
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": c.id, "content": "22 degrees, sunny"} for c in calls],
        {"role": "user", "content": "And what time is it there?"},
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = {"messages": messages, "tools": tools, "tool_choice": named, **STRUCTURED}
    second = client.chat.completions.create(**kwargs)
    (call,) = second.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    streamed, _ = _streamed_call(client, **kwargs)
    assert streamed == [{"name": "get_time", "arguments": call.function.arguments}]


def test_tool_choice_errors(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]}
    unknown = {**base, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert "nope" in _error(_post(server, "/v1/chat/completions", unknown), 400)["message"]
    both = {**base, "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert "tool_choice" in _error(_post(server, "/v1/chat/completions", both), 400)["message"]
    auto = _post(server, "/v1/chat/completions", {**base, "max_tokens": 4})
    assert auto.status_code == 200  # "auto" with --enable-auto-tool-choice: hermes parses
