"""The Responses API's parts without a server: a reply's text (recorded model texts, in chunks)
through the chat path's parsers into output items and typed stream events, read back by the
`openai` SDK's own stream accumulator; the response store's bounds; items as chat messages;
what a request may not ask for."""

from __future__ import annotations

import json
import random

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import ValidationError

from pagellm.entrypoints.openai.chat_reply import ChatReply, tool_parser_for
from pagellm.entrypoints.openai.responses_output import ResponseRun
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest, items_to_messages
from pagellm.entrypoints.openai.responses_store import ResponseStore
from pagellm.outputs import CompletionOutput, RequestOutput

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
HERMES = (
    "Let me check.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
THINKING = "<think>The user wants the weather.</think>\n\n<tool_call>\n" + (
    f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
)


def _outputs(text: str, seed: int, finish: str = "stop") -> list[RequestOutput]:
    """The text as the engine's DELTA outputs: chunks of 1-6 characters, one token each."""
    rng, chunks, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i : i + n])
        i += n
    return [
        RequestOutput(
            request_id="r",
            prompt=None,
            prompt_token_ids=[1, 2, 3],
            outputs=[
                CompletionOutput(
                    0, chunk, [k], None, None, finish if k == len(chunks) - 1 else None
                )
            ],
            finished=k == len(chunks) - 1,
            num_cached_tokens=2 if k == 0 else 0,
        )
        for k, chunk in enumerate(chunks)
    ]


def _run(text, seed, stream, mode="auto", reasoning=None, finish="stop"):
    reply = ChatReply(tool_parser_for(mode, "hermes", None), reasoning)
    run = ResponseRun({"id": "resp_1", "model": "m"}, reply, 3, stream)
    frames = run.started() if stream else ""
    for out in _outputs(text, seed, finish):
        run.add(out)
        frames += run.output.drain()
    frames += run.ended() if stream else ""
    if not stream:
        run.finish()
    return run, frames


def _events(frames: str) -> list[dict]:
    """Each frame is `event: TYPE` then `data: JSON` with the same type."""
    events = []
    for frame in frames.strip().split("\n\n"):
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def _sdk_final(events: list[dict]):
    """The response the openai SDK's stream helper assembles from these events."""
    state = ResponseStreamState(input_tools=[], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return state._completed_response


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hermes_calls_become_function_call_items_streamed_or_not(seed):
    run, frames = _run(HERMES, seed, stream=True)
    events = _events(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    message, weather, time_call = run.output.items
    assert message["content"][0]["text"] == "Let me check.\n"
    assert (weather["name"], weather["arguments"], weather["status"]) == (
        "get_weather", WEATHER_ARGS, "completed",
    )  # fmt: skip
    assert json.loads(time_call["arguments"]) == {"zone": "CET"}
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    assert "".join(deltas) == WEATHER_ARGS + time_call["arguments"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == [WEATHER_ARGS, time_call["arguments"]]
    final = _sdk_final(events)
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.output_text == "Let me check.\n" and final.output[1].name == "get_weather"
    assert final.usage.input_tokens_details.cached_tokens == 2
    whole, _ = _run(HERMES, seed + 10, stream=False)
    assert _without_ids(whole.output.items) == _without_ids(run.output.items)


def test_reasoning_and_a_call_with_the_qwen3_parser():
    run, frames = _run(THINKING, 3, stream=True, reasoning="qwen3")
    reasoning, call = run.output.items  # the blank line before the call is no message
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [
        {"type": "reasoning_text", "text": "The user wants the weather."}
    ]
    assert call["name"] == "get_weather" and call["arguments"] == WEATHER_ARGS
    events = _events(frames)
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "The user wants the weather."
    usage = _sdk_final(events).usage
    # the tokens (one a chunk here) before the answer began: the span and its tags
    chunks = len(_outputs(THINKING, 3))
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens == chunks
    ends = THINKING.index("</think>") + len("</think>")
    assert usage.output_tokens_details.reasoning_tokens >= len(_outputs(THINKING[:ends], 3)) - 1


def test_a_cut_reply_leaves_the_response_and_its_last_item_incomplete():
    run, frames = _run(HERMES[:60], 4, stream=True, finish="length")
    events = _events(frames)
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][-1]["type"] == "function_call"
    assert response["output"][-1]["status"] == "incomplete"  # its arguments do not parse
    text, _ = _run("Plain words, cut", 5, stream=False, mode=None, finish="length")
    (message,) = text.output.items
    assert message["status"] == "incomplete" and text.status == "incomplete"
    assert message["content"][0]["text"] == "Plain words, cut"


def test_the_store_is_bounded_by_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
        now[0] += 1.0
    assert store.get("r0") is None  # the oldest, past the count
    assert store.get("r1").response == {"id": "r1"} and store.get("r2") is not None
    now[0] = 11.5  # r1, kept at 1.0, has expired; r2, kept at 2.0, not yet
    assert store.get("r1") is None and store.get("r2") is not None
    now[0] = 12.0
    assert store.get("r2") is None and not store.entries
    none = ResponseStore(max_entries=0, ttl_s=10.0)
    none.put("r", {}, [])
    assert none.get("r") is None


def test_items_become_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "22 degrees"},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
    ]  # fmt: skip
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "Weather in Paris?"
    assert messages[2]["content"] == "Checking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"}
    assert messages[4]["content"] == "" and messages[4]["tool_calls"][0]["id"] == "c3"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]: the item type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "built-in tool 'web_search'"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice 'file_search'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text only"),
        ({"input": "x", "background": True}, "background responses are not supported"),
        ({"input": "x", "truncation": "auto"}, "truncation 'auto' is not supported"),
    ],
)
def test_what_a_request_may_not_ask_for_is_refused_in_words(body, words):
    with pytest.raises(ValidationError, match=words.replace("[", r"\[")):
        ResponsesRequest.model_validate(body)


def test_a_request_becomes_the_chat_it_amounts_to():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    request = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "tools": [tool],
        "tool_choice": {"type": "function", "name": "f"}, "temperature": 0.0, "top_k": 3,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = request.to_chat_request(request.input_messages())
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Hi"),
    ]  # fmt: skip
    assert chat.max_completion_tokens == 7 and chat.top_k == 3 and chat.temperature == 0.0
    function = {"name": "f", "parameters": {"type": "object"}}
    assert chat.tools == [{"type": "function", "function": function}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format["json_schema"]["schema"] == {"type": "object"}
    both = ResponsesRequest.model_validate(
        {"input": "Hi", "text": {"format": {"type": "json_object"}},
         "response_format": {"type": "json_object"}}
    )  # fmt: skip
    with pytest.raises(ValueError, match="only one output constraint"):
        both.to_chat_request([])
    unknown = ResponsesRequest.model_validate({"input": "Hi", "max_tokens": 5})
    with pytest.raises(ValueError, match="max_tokens is not supported"):
        unknown.to_chat_request([])
