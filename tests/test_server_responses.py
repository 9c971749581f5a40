"""POST /v1/responses and GET /v1/responses/{id} through the official `openai` SDK
(`client.responses.create`, `.stream`, `.retrieve`), greedy and short.

conftest's shared `api_server` (the embedded model, `--tool-call-parser hermes`) answers most
tests, each checked against the same server's /v1/chat/completions for the same conversation.
A second server (a tiny random Llama, `--reasoning-parser deepseek_r1`, a store of 2 entries
for a few seconds) checks the store's bounds and reasoning items.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from server_utils import Server, start_server, stop_server, wait_healthy, wait_kv_free
from timing import scaled

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHORT = {"max_output_tokens": 5, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
HAIKU = "Write a haiku about the sea."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
WEATHER = {
    "type": "function",
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
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(api_server) -> Server:
    return api_server


@pytest.fixture(scope="module")
def client(api_client):
    return api_client


def _chat(client, messages, max_tokens=5, **kwargs):
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True}, **kwargs,
    )  # fmt: skip
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_text_input_is_the_chat_with_one_user_message(client):
    out = client.responses.create(model=MODEL, input=HAIKU, **SHORT)
    text, prompt_tokens = _chat(client, [{"role": "user", "content": HAIKU}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == text and text
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    # cut by max_output_tokens, as OpenAI reports it
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    usage = out.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt_tokens, 5)
    assert usage.total_tokens == prompt_tokens + 5
    assert usage.output_tokens_details.reasoning_tokens == 0
    again = client.responses.create(model=MODEL, input=HAIKU, **SHORT)
    assert again.output_text == text  # the prompt's full blocks now come from the prefix cache
    assert 0 < again.usage.input_tokens_details.cached_tokens < prompt_tokens


def test_items_and_instructions_are_the_chat_they_amount_to(client):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Bonjour !"}]},
        {"role": "user", "content": "How are you?"},
    ]  # fmt: skip
    out = client.responses.create(model=MODEL, input=items, instructions="Be kind.", **SHORT)
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ]
    text, prompt_tokens = _chat(client, messages)
    assert out.output_text == text and out.usage.input_tokens == prompt_tokens
    assert out.instructions == "Be kind." and out.max_output_tokens == 5


def test_json_schema_format_streamed_with_the_sdk_helper(client):
    """A reply that ends by itself: completed, valid by the schema; the stream's events in
    OpenAI's order, numbered, their deltas the final text; the same as not streamed."""
    kwargs = dict(model=MODEL, input="Give me a person as JSON.", text=PERSON_FORMAT)
    whole = client.responses.create(**kwargs, temperature=0.0, max_output_tokens=64)
    assert whole.status == "completed" and whole.incomplete_details is None
    jsonschema.validate(json.loads(whole.output_text), PERSON)
    with client.responses.stream(**kwargs, temperature=0.0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert kinds[: deltas[0]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert deltas == list(range(deltas[0], deltas[-1] + 1))
    assert kinds[deltas[-1] + 1 :] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(events[i].delta for i in deltas) == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_cut_stream_ends_incomplete(client):
    events = list(client.responses.create(model=MODEL, input=HAIKU, stream=True, **SHORT))
    text, _ = _chat(client, [{"role": "user", "content": HAIKU}])
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert last.response.output_text == text and last.response.usage.output_tokens == 5


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", instructions="Be brief.", **SHORT
    )
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, **SHORT
    )
    # the first exchange, without its instructions (a response does not inherit them)
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    text, prompt_tokens = _chat(client, messages)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens and second.output_text == text
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    assert stored.usage.input_tokens == first.usage.input_tokens


def test_store_false_keeps_nothing(client):
    out = client.responses.create(model=MODEL, input="Hi", store=False, **SHORT)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=out.id, **SHORT)


def test_a_named_function_call_and_its_output_fed_back(client, llm):
    """tool_choice names a function: the reply is its arguments (a constraint), a
    function_call item. Fed back with a function_call_output, both are in the prompt: the
    assistant's tool call and the tool's message, as chat renders them."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=MODEL, input=[ask], tools=[WEATHER], tool_choice=named, temperature=0.0,
        max_output_tokens=64,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = "22 degrees and sunny in Paris"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    tools = dict(tools=[WEATHER], tool_choice="none", **SHORT)
    fed = client.responses.create(model=MODEL, input=[ask, call, output], **tools)
    chained = client.responses.create(
        model=MODEL, input=[output], previous_response_id=first.id, **tools
    )
    function = {"name": call.name, "arguments": call.arguments}
    chat_call = {"id": call.call_id, "type": "function", "function": function}
    messages = [
        ask,
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    text, prompt_tokens = _chat(client, messages, tools=[CHAT_WEATHER], tool_choice="none")
    assert fed.usage.input_tokens == chained.usage.input_tokens == prompt_tokens
    assert fed.output_text == chained.output_text == text
    rendered = llm.get_tokenizer().apply_chat_template(
        messages, tools=[CHAT_WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert result in rendered and len(llm.get_tokenizer().encode(rendered)) == prompt_tokens
    longer = {**output, "output": result + ", with a light breeze from the west"}
    grown = client.responses.create(model=MODEL, input=[ask, call, longer], **tools)
    assert grown.usage.input_tokens > fed.usage.input_tokens


def test_required_tool_choice_streams_function_call_events(client):
    kwargs = dict(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", temperature=0.0, max_output_tokens=64,
    )  # fmt: skip
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == "".join(done) == "".join(c.arguments for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])


@pytest.mark.parametrize(
    "kwargs, status, words",
    [
        ({"previous_response_id": "resp_unknown"}, 404, "no response with id 'resp_unknown'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "item type 'item_reference'"),
        ({"tools": [{"type": "web_search"}]}, 400, "built-in tool 'web_search' is not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "content part type 'input_image'"),
        ({"background": True}, 400, "background responses are not supported"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
         400, "arguments must be JSON"),
        ({"extra_body": {"max_tokens": 3}}, 400, "max_tokens is not supported"),
    ],
)  # fmt: skip
def test_bad_requests_are_4xx_in_our_words(client, server, kwargs, status, words):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(**body)
    assert e.value.status_code == status and words in e.value.message
    assert httpx.get(f"{server.url}/health").status_code == 200  # the next tests generate


def test_the_server_serves_after_the_bad_requests(client):
    text, _ = _chat(client, [{"role": "user", "content": "Hi"}])
    assert client.responses.create(model=MODEL, input="Hi", **SHORT).output_text == text


def test_a_stream_left_midway_frees_its_request(client, server):
    with client.responses.create(
        model=MODEL, input=HAIKU, stream=True, max_output_tokens=400, temperature=0.0,
        extra_body={"ignore_eos": True},
    ) as stream:  # fmt: skip
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    wait_kv_free(server, timeout=60)


def test_the_openapi_document_lists_the_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "post" in paths["/v1/responses"] and "get" in paths["/v1/responses/{response_id}"]


# ---- a second server: the store's bounds, reasoning items ----------------------------------

STORE_MAX = 2


@pytest.fixture(scope="module")
def small(tiny_chat_model, tmp_path_factory):
    ttl = scaled(4.0)  # long enough for a few requests on this machine's load now
    args = [tiny_chat_model, "--max-model-len", "128", "--reasoning-parser", "deepseek_r1"]
    args += ["--responses-store-max", str(STORE_MAX), "--responses-store-ttl", f"{ttl:.1f}"]
    srv = start_server(args, str(tmp_path_factory.mktemp("responses") / "server.log"))
    try:
        wait_healthy(srv)
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as c:
            yield c, ttl
    finally:
        stop_server(srv)


def test_the_store_keeps_the_newest_for_its_ttl(small):
    client, ttl = small
    model = client.models.list().data[0].id
    ids = [client.responses.create(model=model, input=f"Hi {i}", **SHORT).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # past --responses-store-max 2
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    time.sleep(ttl + 0.5)
    for response_id in ids[1:]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)


def test_the_reasoning_parser_makes_reasoning_items(small):
    """deepseek_r1: the reply is reasoning until `</think>` (never written by this model)."""
    client, _ = small
    model = client.models.list().data[0].id
    out = client.responses.create(model=model, input="Think.", **SHORT)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Think."}], max_tokens=5,
        temperature=0.0, extra_body={"ignore_eos": True},
    ).choices[0].message  # fmt: skip
    (item,) = out.output
    assert item.type == "reasoning" and item.content[0].text == chat.reasoning_content
    assert out.output_text == "" and out.usage.output_tokens_details.reasoning_tokens == 5
    events = list(client.responses.create(model=model, input="Think.", stream=True, **SHORT))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == chat.reasoning_content
    assert events[-1].response.output[0].type == "reasoning"
