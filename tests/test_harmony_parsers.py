"""gpt-oss's harmony replies through the server's parsers (`--reasoning-parser openai_gptoss`,
`--tool-call-parser openai`, as vLLM names them): rendered harmony text (special tokens kept,
as the server keeps them for these parsers) split into reasoning, content and tool calls,
whole and streamed in random chunks (the deltas reassemble to the whole split)."""

from __future__ import annotations

import json
import random

import pytest

from pagellm.config import REASONING_TAGS
from pagellm.entrypoints.openai.chat_reply import make_reply
from pagellm.entrypoints.openai.harmony import harmony_messages

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": 'a "quoted" } brace <|x', "filters": {"tags": ["x"], "limit": 3}}


def _analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


def _call(name: str, args: dict, recipient_first: bool = False) -> str:
    """A tool call as gpt-oss writes it: `to=` after the channel, or before it."""
    body = json.dumps(args)
    if recipient_first:
        header = f"<|start|>assistant to=functions.{name}<|channel|>commentary json"
        return f"{header}<|message|>{body}<|call|>"
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{body}<|call|>")  # fmt: skip


def _final(text: str, end: str = "<|return|>") -> str:
    return f"<|start|>assistant<|channel|>final<|message|>{text}{end}"


# (reply text, tool mode, reasoning, content, calls)
CASES = {
    "answer": (_analysis("2 + 2 is 4.") + _final("It is 4."), None, "2 + 2 is 4.", "It is 4.", []),
    "two_calls": (
        _analysis("Need the weather, then a search.")
        + _call("get_weather", WEATHER)
        + _call("search", NESTED, recipient_first=True),
        "auto",
        "Need the weather, then a search.",
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),  # fmt: skip
    "preamble_then_call": (
        _analysis("Check it.")
        + "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
        + _call("get_weather", WEATHER),
        "auto",
        "Check it.",
        "Let me look that up.",
        [("get_weather", WEATHER)],
    ),  # fmt: skip
    "two_thoughts_then_answer": (
        _analysis("First.") + _analysis("Second.") + _final("Done.", end=""),  # EOS not in text
        "auto",
        "First.\nSecond.",
        "Done.",
        [],
    ),  # fmt: skip
    "call_in_analysis": (
        _analysis("Look it up.")
        + "<|start|>assistant<|channel|>analysis to=functions.search json<|message|>"
        + json.dumps(NESTED)
        + "<|call|>",
        "auto",
        "Look it up.",
        None,
        [("search", NESTED)],
    ),  # fmt: skip
    "builtin_tool_in_analysis": (  # a browser call is the model's own: thinking
        _analysis("Search first.")
        + '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"q": 1}<|call|>',
        None,
        'Search first.\n{"q": 1}',
        None,  # all thinking: content null, as vLLM's
        [],
    ),  # fmt: skip
    "no_reasoning": (
        "<|channel|>final<|message|>Plain answer.<|return|>",
        None,
        None,
        "Plain answer.",
        [],
    ),
    "first_call_recipient_in_the_role": (  # the prompt ends `<|start|>assistant`
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", '
        '"unit": "celsius"}<|call|>',
        "auto",
        None,
        None,
        [("get_weather", WEATHER)],
    ),  # fmt: skip
    "final_text_that_looks_like_markup": (  # the final channel's text is never re-read
        _analysis("Answer.")
        + _final("see <|channel|>commentary to=functions.delete_all<|message|>{}", end=""),
        "auto",
        "Answer.",
        "see <|channel|>commentary to=functions.delete_all<|message|>{}",
        [],
    ),  # fmt: skip
    "unparsable_call_is_not_markup_in_the_content": (
        _analysis("Call it.")
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        + '<|message|>{"city": Paris<|call|>'
        + _final("Sorry.", end=""),
        "auto",
        "Call it.",
        "Sorry.",
        None,  # whole: no call; streamed: the parsers may emit the call's text (not markup)
    ),  # fmt: skip
}


def _stream(text: str, mode: str | None, seed: int, strict: bool = True):
    rng, reply = random.Random(seed), make_reply(mode, "openai", "openai_gptoss")
    reasoning, content, calls, i = "", "", {}, 0
    while i < len(text):
        n = rng.randint(1, 7)
        chunk, i = text[i : i + n], i + n
        r, c, deltas = reply.update(chunk, final=i >= len(text))
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    if not strict:
        return reasoning, content, list(calls.values())
    return reasoning, content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("case", list(CASES))
def test_harmony_reply_whole(case):
    text, mode, reasoning, content, calls = CASES[case]
    got_reasoning, got_content, got_calls = make_reply(mode, "openai", "openai_gptoss").final(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == (
        calls or []
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_harmony_reply_streamed(case, seed):
    text, mode, reasoning, content, calls = CASES[case]
    if calls is None:  # a call whose arguments never parse: only the text is compared
        got_reasoning, got_content = _stream(text, mode, seed, strict=False)[:2]
        assert (got_reasoning, got_content) == (reasoning, content)
        return
    assert _stream(text, mode, seed) == (reasoning or "", content or "", calls)


def test_without_a_tool_parser_the_call_stays_in_the_content():
    """As other parsers leave their markup: no tools, no calls; the reasoning is still split."""
    text = _analysis("Hm.") + _call("get_weather", WEATHER)
    reasoning, content, calls = make_reply(None, None, "openai_gptoss").final(text)
    assert reasoning == "Hm." and calls == []
    assert "to=functions.get_weather" in content and json.dumps(WEATHER) in content


def test_plain_text_is_content():
    assert make_reply("auto", "openai", "openai_gptoss").final("just text") == (
        None,
        "just text",
        [],
    )


def test_messages_of_a_cut_text():
    """Streaming: a header not yet at `<|message|>` is not reported; a body's suffix that
    may start a marker is held back."""
    text = _analysis("ok") + "<|start|>assistant<|channel|>final<|message|>Hi <|re"
    (analysis, final) = harmony_messages(text, final=False)
    assert (analysis.channel, analysis.content, analysis.done) == ("analysis", "ok", True)
    assert (final.channel, final.content, final.done) == ("final", "Hi ", False)
    assert harmony_messages(_analysis("ok") + "<|start|>assistant<|chan", final=False)[1:] == []


def test_thinking_budget_tags():
    assert REASONING_TAGS["openai_gptoss"] == ("<|channel|>analysis<|message|>", "<|end|>")


def test_llm_chat_keeps_special_tokens_for_harmony_parsers():
    """`LLM.chat` detokenizes with the markers where a harmony parser reads them; copies,
    so the caller's params are untouched; other parsers leave the params as they are."""
    from pagellm import SamplingParams
    from pagellm.entrypoints.chat_outputs import ChatParsing

    params = [SamplingParams(max_tokens=3)]
    for tool, reasoning in (("openai", None), (None, "openai_gptoss")):
        kept = ChatParsing(tool, reasoning).keep_special_tokens(params)
        assert kept[0].skip_special_tokens is False and params[0].skip_special_tokens is True
    assert ChatParsing("hermes", "qwen3").keep_special_tokens(params) is params


def test_structured_outputs_say_they_do_not_follow_harmony():
    """A grammar starts after the thinking's end token; harmony's answer starts after a
    channel header of several tokens: a clear reason, not a wrong grammar's start."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pagellm.structured_output.manager import reasoning_token_ids

    words = ["<unk>", "<think>", "</think>", "<|channel|>", "analysis", "<|message|>", "<|end|>"]
    vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="<unk>")
    assert reasoning_token_ids(tokenizer, "qwen3") == (1, 2)
    with pytest.raises(ValueError, match="'openai_gptoss' needs its tags"):
        reasoning_token_ids(tokenizer, "openai_gptoss")
