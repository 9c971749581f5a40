"""`parallel_tool_calls: false` gives at most one call (OpenAI's and
vLLM's behaviour: chat and responses, tool_choice "required" or "auto"), and a Responses
request's `include: []` (what SDKs send by default) is taken, a non-empty one refused in words.

conftest's shared `api_server` (the embedded model, `--tool-call-parser hermes`), greedy.
"""

from __future__ import annotations

from server_utils import post

from pagellm.entrypoints.openai.chat_reply import make_reply

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
ASK = "What is the weather in Paris, Rome, Berlin and Madrid? Call the tool once per city."
GREEDY = {"temperature": 0.0}


def _chat_calls(client, parallel, stream=False):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=parallel, max_tokens=150, stream=stream,
        **GREEDY,
    )  # fmt: skip
    if not stream:
        return len(out.choices[0].message.tool_calls)
    return len({tc.index for c in out for ch in c.choices for tc in ch.delta.tool_calls or []})


def test_parallel_tool_calls_false_gives_one_call(api_client):
    client = api_client
    assert _chat_calls(client, True) > 1  # the model calls several times when it may
    assert _chat_calls(client, False) == 1
    assert _chat_calls(client, False, stream=True) == 1
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    out = client.responses.create(
        model=MODEL, input=ASK, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=150, **GREEDY,
    )  # fmt: skip
    assert [item.type for item in out.output] == ["function_call"]
    assert out.parallel_tool_calls is False


def test_auto_tool_choice_keeps_the_first_call_when_not_parallel():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call>'
    )
    whole = make_reply("auto", "hermes", None)
    whole.max_calls = 1
    _, _, calls = whole.final(text)
    assert [c["function"]["name"] for c in calls] == ["a"]
    streamed = make_reply("auto", "hermes", None)
    streamed.max_calls = 1
    deltas = [d for i, ch in enumerate(text) for d in streamed.update(ch, i == len(text) - 1)[2]]
    assert {d["index"] for d in deltas} == {0}


def test_responses_take_an_empty_include(api_client, api_server):
    client, server = api_client, api_server
    out = client.responses.create(model=MODEL, input="Hi", include=[], max_output_tokens=3)
    assert out.status == "incomplete"
    response = post(
        server, "/v1/responses", {"input": "Hi", "include": ["file_search_call.results"]}
    )
    assert response.status_code == 400
    assert "include" in response.json()["error"]["message"]
