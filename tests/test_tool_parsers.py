"""Tool-call and reasoning parsers on recorded model texts: the calls and content found, and
the same when the text arrives in small chunks (streamed deltas reassemble to the calls)."""

from __future__ import annotations

import json
import random

import pytest

from pagellm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from pagellm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    JsonListToolParser,
    ToolCallStream,
    final_calls,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": 'a "quoted" } brace', "filters": {"tags": ["x", "y"], "limit": 3}}

RECORDED = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "a \\"quoted\\" } brace", '
        '"filters": {"tags": ["x", "y"], "limit": 3}}}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "search", "parameters": {"query": "a \\"quoted\\" } brace", '
        '"filters": {"tags": ["x", "y"], "limit": 3}}}',
        "",
    ),
    "mistral": (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "search", "arguments": {"query": "a \\"quoted\\" } brace", '
        '"filters": {"tags": ["x", "y"], "limit": 3}}}]',
        "Sure. ",
    ),
    "pythonic": (
        '[get_weather(city="Paris", unit="celsius"), search(query="a \\"quoted\\" } brace", '
        'filters={"tags": ["x", "y"], "limit": 3})]',
        "",
    ),
}


def _stream(parser, text: str, seed: int) -> tuple[str, dict[int, dict]]:
    """Feed `text` in random chunks of 1-6 characters; gather content and calls by index."""
    rng, stream = random.Random(seed), ToolCallStream(parser)
    content, calls, i = "", {}, 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunk, i = text[i : i + n], i + n
        got, deltas = stream.update(chunk, final=i >= len(text))
        content += got
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["name"] is None and call["arguments"] == ""  # the name comes first
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parser_finds_the_calls(name):
    text, content = RECORDED[name]
    parsed = TOOL_PARSERS[name]().parse(text, final=True)
    calls = final_calls(parsed)
    assert parsed.content == content
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert [json.loads(c.arguments) for c in calls] == [WEATHER, NESTED]
    for seed in range(3):
        streamed_content, streamed = _stream(TOOL_PARSERS[name](), text, seed)
        assert streamed_content == content
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.name, c.arguments) for c in calls
        ]
        assert len({c["id"] for c in streamed.values()}) == 2


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_plain_text_is_content(name):
    text = "The weather in Paris is mild. [1] {braces} <b>"
    assert TOOL_PARSERS[name]().parse(text, final=True).content == text
    content, calls = _stream(TOOL_PARSERS[name](), text, 0)
    assert content == text and not calls


def test_hermes_holds_back_a_split_tag():
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert stream.update("Hi <tool_", final=False) == ("Hi ", [])
    content, deltas = stream.update('call>{"name": "f", "arguments": {"a"', final=False)
    assert content == "" and deltas[0]["function"]["name"] == "f"
    assert deltas[1]["function"]["arguments"] == '{"a"'


def test_required_json_list():
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    calls = final_calls(JsonListToolParser().parse(text, final=True))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]


REASONING = {
    "qwen3": ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n"),
    "deepseek_r1": ("The user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.\n"),
}


@pytest.mark.parametrize("name", sorted(REASONING))
def test_reasoning_split_and_stream(name):
    text, reasoning = REASONING[name]
    parser = REASONING_PARSERS[name]()
    assert parser.split(text, final=True) == (reasoning, "\n\nIt is 4.")
    # every split point, the end tag cut in two included
    for cut in range(1, len(text)):
        stream = ReasoningStream(parser)
        r1, c1 = stream.update(text[:cut], final=False)
        r2, c2 = stream.update(text[cut:], final=True)
        assert (r1 + r2, c1 + c2) == (reasoning, "\n\nIt is 4."), cut
        assert "<" not in r1 + c1 or "<think>" in text[:cut]  # no half tag shown


def test_reasoning_without_tags():
    assert REASONING_PARSERS["qwen3"]().split("Just 4.", final=True) == (None, "Just 4.")
    assert REASONING_PARSERS["deepseek_r1"]().split("still thinking", final=True) == (
        "still thinking",
        "",
    )
