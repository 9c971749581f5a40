"""Pydantic models of OpenAI's Responses API (`POST /v1/responses`): the request with its input
items, function tools and text format, and the response object it answers with.

A Responses request is a chat in other clothes: `to_chat_request()` turns it into the
`ChatCompletionRequest` it amounts to (instructions as the system message, then the stored
conversation of `previous_response_id`, then the input items as messages; function tools,
`tool_choice`, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`), so that rendering, tools, sampling and output constraints are
chat's, with chat's checks. The sampling fields and vLLM's extras are `SamplingRequest`'s.

Input items: messages (role user, system, developer or assistant; content a string or
`input_text` / `output_text` parts), `function_call` items (an earlier reply's calls: the
assistant's `tool_calls`), `function_call_output` items (a `tool` message) and `reasoning`
items (an earlier reply's thinking: not part of the prompt, as chat templates drop it).
What this server cannot do (built-in tools, other content parts, `background`,
`truncation: "auto"`) is refused with a 400 saying so, before anything else is read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    NonEmptyText,
    RequestModel,
    SamplingInt,
    SamplingRequest,
    Text,
)

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
_ROLES = {"developer": "system"}  # a developer message is the system's, for chat templates
# the SamplingRequest fields a chat request takes as they are (n: a response has one reply)
_SAMPLING_FIELDS = set(SamplingRequest.model_fields) - {"n"}


class TextPart(RequestModel):
    """A text content part: `input_text` (sent) or `output_text` (an earlier reply's)."""

    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextPart]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Text  # JSON text, as the reply gave it


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text | list[TextPart]


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    """An input item's type; a message may leave it out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: NonEmptyText
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: NonEmptyText


class PlainTextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    name: Text = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: (
        Annotated[
            PlainTextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
        ]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: changes nothing here

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's `response_format` for this text format."""
        spec = self.format
        if spec is None or spec.type == "text":
            return None
        if spec.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": spec.name, "schema": spec.schema_}}


class ReasoningConfig(RequestModel):
    """`effort` low / medium / high is the chat template's `reasoning_effort` (gpt-oss's
    system message), as the chat route's field of that name; other values and `summary` are
    accepted and not acted on: the model thinks as its template and `--reasoning-parser` say."""

    effort: Text | None = None
    summary: Text | None = None


class ResponsesRequest(SamplingRequest):
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: SamplingInt("max_tokens") | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: NonEmptyText | None = None
    store: bool = True
    parallel_tool_calls: bool = True
    # what OpenAI adds to the output on request; none of it is given here: only an empty list
    # (what SDKs such as openai-agents send by default) is taken; refused in words when not
    # empty: see unsupported_in
    include: Annotated[list[Text], Field(max_length=0)] | None = None
    background: Literal[False] | None = None  # refused when true: see unsupported_in
    truncation: Literal["disabled"] | None = None
    n: Literal[1] = 1

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        problem = unsupported_in(data) if isinstance(data, dict) else None
        if problem is not None:
            raise ValueError(problem)
        return data

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages([item.model_dump(by_alias=True) for item in self.input])

    def to_chat_request(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this request amounts to, after `conversation` (the stored one and
        this input, as chat messages)."""
        field = self.unsupported()
        if field is not None:
            raise ValueError(f"{field} is not supported by this server")
        system = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        body = self.model_dump(by_alias=True, exclude_unset=True, include=_SAMPLING_FIELDS)
        body["messages"] = system + conversation
        body["max_completion_tokens"] = self.max_output_tokens
        body["response_format"] = self._response_format()
        if self.tools:
            body["tools"] = [tool.to_chat() for tool in self.tools]
        body["tool_choice"] = self._chat_tool_choice()
        body["parallel_tool_calls"] = self.parallel_tool_calls
        effort = None if self.reasoning is None else self.reasoning.effort
        if effort in ("low", "medium", "high"):
            body["reasoning_effort"] = effort
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # what the items became is not a chat (never expected)
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"the input does not make a chat: {where}: {error['msg']}") from None

    def _response_format(self) -> dict[str, Any] | None:
        from_text = self.text.response_format() if self.text is not None else None
        if from_text is not None and self.response_format is not None:
            raise ValueError(
                "only one output constraint at a time, got ['text.format', 'response_format']"
            )
        return from_text if from_text is not None else self.response_format

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return {"type": "function", "function": {"name": choice.name}}
        return choice

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response states them."""
        text = {"format": {"type": "text"}}
        if self.text is not None and self.text.format is not None:
            text = {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": (self.model_extra or {}).get("metadata"),
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": None if self.reasoning is None else self.reasoning.model_dump(),
            "store": self.store,
            "temperature": self.temperature,
            "text": text,
            "tool_choice": choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "top_p": self.top_p,
            "user": self.user,
        }


def unsupported_in(body: dict[str, Any]) -> str | None:
    """What a request asks for that this server cannot do, in words, or None."""
    if body.get("background") is True:
        return "background responses are not supported by this server: send stream or wait"
    include = body.get("include")
    if isinstance(include, list) and include:
        return (
            f"include {include!r} is not supported by this server: it adds none of these "
            "to a response (send no include, or an empty list)"
        )
    if body.get("truncation") == "auto":
        return (
            "truncation 'auto' is not supported by this server: an input longer than the "
            "context is refused (truncation 'disabled')"
        )
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            return (
                f"tools[{i}]: the built-in tool {kind!r} is not supported by this server: "
                "only function tools (type 'function')"
            )
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        if choice["type"] != "function":
            return (
                f"tool_choice {choice['type']!r} is not supported by this server: 'none', "
                "'auto', 'required' or {'type': 'function', 'name': ...}"
            )
    items = body.get("input")
    return _unsupported_items(items) if isinstance(items, list) else None


def _unsupported_items(items: list[Any]) -> str | None:
    for i, item in enumerate(items):
        kind = _item_type(item)
        if not isinstance(item, dict) or not isinstance(kind, str):
            continue  # the schema's error says what is wrong
        if kind not in ITEM_TYPES:
            return (
                f"input[{i}]: the item type {kind!r} is not supported by this server "
                f"({', '.join(ITEM_TYPES)})"
            )
        field = "output" if kind == "function_call_output" else "content"
        parts = item.get(field) if kind != "reasoning" else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            part_type = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_type, str) and part_type not in PART_TYPES:
                return (
                    f"input[{i}].{field}[{j}]: the content part type {part_type!r} is not "
                    f"supported by this server: text only ({', '.join(PART_TYPES)})"
                )
    return None


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (input items, or a reply's output items) as chat messages: a
    function_call joins the assistant message before it as one of its `tool_calls` (a new
    assistant message if there is none), a function_call_output is a `tool` message, and a
    reasoning item is left out. Only dicts made here are changed."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item["role"], item["role"])
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item["output"])
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return messages


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)
