"""`LLM.chat` / `LLM.chat_stream` split replies exactly as the server's /v1/chat/completions
does (content, reasoning_content, tool_calls), and the prefix cache's hits reach the server's
`usage.prompt_tokens_details.cached_tokens` and `RequestOutput.num_cached_tokens`.

The model: a tiny random Llama with SmolLM2's tokenizer plus `<think>` / `</think>` tokens (a
reasoning parser's structured outputs need them) and a chat template that closes the
thinking in the prompt, so that a regex constrains the whole reply: the model is made to
write `<think>...</think>` and hermes `<tool_call>` blocks. One `pagellm serve` and one `LLM`
on it, both with the hermes tool-call parser and the qwen3 reasoning parser, greedy; conftest's
`llm` (the embedded model) is the one without parsers.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from model_utils import make_tiny_chat_model
from server_utils import post, start_server, stop_server, wait_healthy

from pagellm import LLM, SamplingParams
from pagellm.structured_output.params import StructuredOutputsParams

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}"\}\}</tool_call>'
REPLIES = {  # the reply each case forces, as a regex
    "reasoning": r"<think>[a-z]{2,8} [a-z]{2,8}</think>[A-Za-z]{2,8} [a-z]{2,8}",
    "tool_call": CALL,
    "both": r"<think>[a-z]{2,8}</think>Sure\. " + CALL,
}
MAX_TOKENS = 64
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
BLOCK_SIZE = 16  # the default


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("think")
    return make_tiny_chat_model(folder, ("<think>", "</think>"), TEMPLATE)


@pytest.fixture(scope="module")
def server_and_llm(think_model, tmp_path_factory):
    """The server boots while the in-process LLM loads."""
    args = [think_model, "--dtype", "float32", "--max-model-len", "512"]
    args += ["--kv-cache-memory-bytes", str(64 << 20), "--reasoning-parser", "qwen3"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server = start_server(args, str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        llm = LLM(think_model, tool_call_parser="hermes", reasoning_parser="qwen3", **ENGINE)
        try:
            wait_healthy(server)
            yield server, llm
        finally:
            llm.shutdown()
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def server(server_and_llm):
    return server_and_llm[0]


@pytest.fixture(scope="module")
def parsed_llm(server_and_llm):
    """The LLM with both parsers (conftest's `llm`, on the embedded model, has none)."""
    return server_and_llm[1]


def _params(regex: str) -> SamplingParams:
    constraint = StructuredOutputsParams(regex=regex)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint)


def _server_chat(server, regex: str, tools: list | None, **extra) -> httpx.Response:
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": MAX_TOKENS}
    body |= {"structured_outputs": {"regex": regex}, **extra}
    if tools:
        body["tools"] = tools
    return post(server, "/v1/chat/completions", body)


def _calls(tool_calls: list[dict]) -> list[tuple[str, str, str]]:
    """(type, name, arguments) of each call; its id is checked for its form only (random)."""
    for call in tool_calls:
        assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) > 20
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


# ---- parser names ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tool_call_parser": "hermez"}, ["tool_call_parser", "hermez", "hermes", "pythonic"]),
        ({"reasoning_parser": "qwen"}, ["reasoning_parser", "qwen", "deepseek_r1", "qwen3"]),
    ],
)
def test_unknown_parser_is_a_value_error_naming_the_valid_ones(kwargs, words):
    with pytest.raises(ValueError) as info:
        LLM(model="/nonexistent/model", **kwargs)  # refused before any model is looked up
    assert all(word in str(info.value) for word in words), info.value


# ---- LLM.chat == the server's message ----------------------------------------------------


@pytest.mark.parametrize("case", list(REPLIES))
def test_chat_equals_the_servers_message(server, parsed_llm, case):
    regex = REPLIES[case]
    response = _server_chat(server, regex, [WEATHER])
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    (out,) = parsed_llm.chat(MESSAGES, _params(regex), use_tqdm=False, tools=[WEATHER])
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"  # the whole forced reply
    assert completion.text == (message["content"] or "")
    assert completion.reasoning_content == message.get("reasoning_content")
    assert _calls(completion.tool_calls) == _calls(message.get("tool_calls") or [])
    # the forced markup was found, and left the content
    assert "<think>" not in completion.text and "<tool_call>" not in completion.text
    assert (completion.reasoning_content is not None) == (case != "tool_call")
    assert len(completion.tool_calls) == (case != "reasoning")
    for call in completion.tool_calls:
        assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_without_tools_the_tool_markup_stays_in_the_content(server, parsed_llm):
    """As the server: no `tools`, no tool parsing (the thinking is still split)."""
    regex = REPLIES["both"]
    message = _server_chat(server, regex, None).json()["choices"][0]["message"]
    completion = parsed_llm.chat(MESSAGES, _params(regex), use_tqdm=False)[0].outputs[0]
    assert completion.text == message["content"] and "<tool_call>" in completion.text
    assert completion.reasoning_content == message["reasoning_content"]
    assert completion.tool_calls is None and not message.get("tool_calls")


def test_without_parsers_outputs_are_unchanged(llm):
    """conftest's `llm` (the embedded model, no parsers): the forced markup stays."""
    regex = r"<think>[a-z]{1,4}</think>" + CALL.replace('"[a-z]{2,8}"', '"x"')
    out = llm.chat(MESSAGES, _params(regex), use_tqdm=False, tools=[WEATHER])[0]
    raw = llm.generate(out.prompt, _params(regex), use_tqdm=False)[0].outputs[0]
    completion = out.outputs[0]
    assert completion.tool_calls is None and completion.reasoning_content is None
    assert completion.text == raw.text and completion.token_ids == raw.token_ids
    assert raw.finish_reason == "stop" and re.fullmatch(regex, raw.text)


# ---- LLM.chat_stream ---------------------------------------------------------------------


def _server_stream(server, regex: str) -> tuple[str, str, list[dict]]:
    """(content, reasoning, calls) reassembled from the server's stream."""
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": MAX_TOKENS, "stream": True}
    body |= {"structured_outputs": {"regex": regex}, "tools": [WEATHER]}
    content, reasoning, calls = "", "", {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or ""
                _add_call_deltas(calls, delta.get("tool_calls") or [])
    return content, reasoning, [calls[i] for i in sorted(calls)]


def _add_call_deltas(calls: dict[int, dict], deltas: list[dict]) -> None:
    for d in deltas:
        if "id" in d:  # a call's first delta: its id and name
            assert d["index"] not in calls and d["function"]["arguments"] == ""
            calls[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]


def test_chat_stream_deltas_add_up_to_chat_and_to_the_servers_stream(server, parsed_llm):
    regex = REPLIES["both"]
    (whole,) = parsed_llm.chat(MESSAGES, _params(regex), use_tqdm=False, tools=[WEATHER])
    content, reasoning, calls, token_ids = "", "", {}, []
    for out in parsed_llm.chat_stream(MESSAGES, _params(regex), tools=[WEATHER]):
        (delta,) = out.outputs
        token_ids += delta.token_ids
        assert "<think>" not in delta.text and "</think>" not in (delta.reasoning_content or "")
        assert not (delta.text and delta.reasoning_content)  # each piece is one or the other
        content += delta.text
        reasoning += delta.reasoning_content or ""
        _add_call_deltas(calls, delta.tool_calls)
    completion = whole.outputs[0]
    assert token_ids == completion.token_ids
    assert (content, reasoning) == (completion.text, completion.reasoning_content)
    streamed = [{k: v for k, v in calls[i].items() if k != "index"} for i in sorted(calls)]
    assert _calls(streamed) == _calls(completion.tool_calls)
    served = _server_stream(server, regex)
    assert served[:2] == (content, reasoning) and _calls(served[2]) == _calls(streamed)


def test_chat_stream_of_a_reply_without_thinking_is_all_content(parsed_llm):
    """The reasoning parser holds back what may start a `<think>`, then gives it all out."""
    regex = r"[a-z]{2,8} [a-z]{2,8}"
    (whole,) = parsed_llm.chat(MESSAGES, _params(regex), use_tqdm=False)
    text = "".join(o.outputs[0].text for o in parsed_llm.chat_stream(MESSAGES, _params(regex)))
    assert text == whole.outputs[0].text and whole.outputs[0].reasoning_content is None
    assert len(text) >= 5


# ---- cached tokens -----------------------------------------------------------------------


PROMPT = "The cached prompt: " + " ".join(f"word{i}" for i in range(24))


def _usage_details(response: httpx.Response) -> tuple[int, int]:
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _assert_cached(first: tuple[int, int], again: tuple[int, int]) -> None:
    assert first[1] == 0 and first[0] == again[0]
    prompt_tokens, cached = again
    assert 0 < cached <= prompt_tokens and cached % BLOCK_SIZE == 0
    assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # all but the last token


def test_completion_usage_reports_cached_tokens(server):
    body = {"prompt": "1 " + PROMPT, "max_tokens": 2, "temperature": 0.0}
    first = _usage_details(post(server, "/v1/completions", body))
    _assert_cached(first, _usage_details(post(server, "/v1/completions", body)))
    n2 = {**body, "prompt": "2 " + PROMPT, "n": 2}  # the second completion hits the first's
    first = _usage_details(post(server, "/v1/completions", n2))
    _assert_cached(first, _usage_details(post(server, "/v1/completions", n2)))


def _streamed_usage(server, path: str, body: dict) -> tuple[int, int]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_chat_usage_reports_cached_tokens_streamed_and_not(server):
    messages = [{"role": "user", "content": "3 " + PROMPT}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0.0}
    first = _streamed_usage(server, "/v1/chat/completions", body)
    _assert_cached(first, _usage_details(post(server, "/v1/chat/completions", body)))
    completion = {"prompt": "4 " + PROMPT, "max_tokens": 2, "temperature": 0.0}
    first = _usage_details(post(server, "/v1/completions", completion))
    _assert_cached(first, _streamed_usage(server, "/v1/completions", completion))


def test_generate_reports_num_cached_tokens(parsed_llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, again = (parsed_llm.generate("5 " + PROMPT, params, use_tqdm=False)[0] for _ in range(2))
    expected = (len(first.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, expected) and expected > 0
    # n = 2: the second completion hits the first's blocks; the request found none cached
    n2 = SamplingParams(temperature=0.0, max_tokens=2, n=2)
    first, again = (parsed_llm.generate("6 " + PROMPT, n2, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, expected)
