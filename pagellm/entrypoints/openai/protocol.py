"""Pydantic models of the OpenAI API's requests the server takes (what it answers:
`response_models.py`).

Field names and defaults are OpenAI's; vLLM's extra sampling fields (`top_k`, `min_p`,
`ignore_eos`, `min_tokens`, `bad_words`, `priority`, `structured_outputs`, `guided_json`,
...) are accepted too. A field this server does not know is refused with a 400 naming it,
unless it is one of the OpenAI fields that change nothing here (`structured.IGNORED_FIELDS`);
known OpenAI features that would change the output and that this engine lacks (`suffix`,
`best_of` above `n`) are refused too. `to_sampling_params()` is where a request becomes a
`SamplingParams` (which raises ValueError for values out of range).

Requests are validated strictly (`"stream": "yes"` or `"n": 2.5` is a 400, not a guess), and
every number has the range the engine can hold, declared in the OpenAPI document: a sampling
field's bounds are `SamplingParams`' own (`sampling_params.RANGES`), narrower only where the
server says so (`MAX_N`, `MAX_LOGPROBS`); `tests/test_sampling_schema.py` holds them equal.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from pagellm.entrypoints.openai.structured import (
    IGNORED_FIELDS,
    structured_outputs,
    unknown_field,
)
from pagellm.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS,
    RANGES,
    TOKEN_ID,
    RequestOutputKind,
    SamplingParams,
)

MAX_LOGPROBS = 20
# sampling fields a request may leave out (None), for the model's defaults to fill
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# OpenAI's limits: one request fans out into n x prompts engine requests, added in one go
MAX_N = 128
MAX_PROMPTS = 2048


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        message = f"must be valid Unicode (a lone surrogate at character {e.start})"
        raise ValueError(message) from None
    return text


def _integral(value: Any) -> Any:
    """JSON's 2.0 is the integer 2, as JSON Schema says; 2.5 stays a float and is refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def IntIn(low: int, high: int) -> Any:  # noqa: N802 (a type)
    """An integer in [low, high]: the bounds on the integer (so the document states them),
    integral floats taken as integers."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]


def SamplingInt(name: str) -> Any:  # noqa: N802 (a type)
    """An integer field of SamplingParams, with its range."""
    return IntIn(RANGES[name].low, RANGES[name].high)


def sampling_float(name: str, default: float | None) -> Any:
    """A float field of SamplingParams, with its range."""
    return Field(default=default, **RANGES[name].bounds())


Text = Annotated[str, AfterValidator(_valid_unicode)]  # what a tokenizer and UTF-8 can take


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return _valid_unicode(text)


# checked after the Unicode check (a length constraint would refuse a lone surrogate first,
# in pydantic's words), declared as minLength
NonEmptyText = Annotated[
    str, AfterValidator(_non_empty), WithJsonSchema({"type": "string", "minLength": 1})
]
# a character that is not whitespace to Python (str.strip, as SamplingParams checks words) nor
# to ECMA-262 (JSON Schema's patterns): the same set in both dialects
_VISIBLE = r"[^\s\x1c-\x1f\x85\ufeff]"


def _word(text: str) -> str:
    if not re.search(_VISIBLE, text):
        raise ValueError("must not be empty or only whitespace")
    return _valid_unicode(text)


Word = Annotated[
    str, AfterValidator(_word), WithJsonSchema({"type": "string", "pattern": _VISIBLE})
]
TokenId = IntIn(TOKEN_ID.low, TOKEN_ID.high)  # the vocabulary is checked later
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
T = TypeVar("T")
Prompts = Annotated[list[T], Field(min_length=1, max_length=MAX_PROMPTS)]  # several prompts
Number = Annotated[float, Field(allow_inf_nan=False)]  # and each field's range: float32's at most
Role = Literal["system", "user", "assistant", "tool", "developer"]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIModel):
    """A request body: strict types (no "yes" for true, no 2.5 for an integer)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False


def _one_of(*branches: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON schema: exactly one of these fields is present and not null (or `schema`)."""
    return {
        "oneOf": [
            {"required": [name], "properties": {name: schema or {"not": {"type": "null"}}}}
            for name, schema in branches
        ]
    }


class StructuredOutputsBody(RequestModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams' fields): exactly one constraint."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra=_one_of(
            ("json", {}), ("regex", {}), ("choice", {}), ("grammar", {}),
            ("json_object", {"const": True}),
        ),
    )  # fmt: skip

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def fields(self) -> dict[str, Any]:
        """The fields the request set, by StructuredOutputsParams' names."""
        return self.model_dump(by_alias=True, exclude_unset=True)


def _known_fields_only(schema: dict[str, Any]) -> None:
    """What the document says of extra="allow" and `unsupported()`: no fields but the declared
    ones and the OpenAI fields ignored here (`structured.IGNORED_FIELDS`, of any value)."""
    schema["additionalProperties"] = False
    for name in sorted(IGNORED_FIELDS):
        schema.setdefault("properties", {}).setdefault(name, {})


def _stream_options_need_stream(schema: dict[str, Any]) -> None:
    """JSON schema of `SamplingRequest._stream_options_need_stream`."""
    schema.setdefault("allOf", []).append({"anyOf": [
        {"required": ["stream"], "properties": {"stream": {"const": True}}},
        {"properties": {"stream_options": {"type": "null"}}},
    ]})  # fmt: skip


def _sampling_schema(schema: dict[str, Any]) -> None:
    _known_fields_only(schema)
    _stream_options_need_stream(schema)


def _chat_schema(schema: dict[str, Any]) -> None:
    _sampling_schema(schema)
    schema["anyOf"] = [  # top_logprobs above 0 needs logprobs
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        {"properties": {"top_logprobs": {"enum": [0, None]}}},
    ]


class SamplingRequest(RequestModel):
    """The fields completions and chat share; unknown ones are kept, to be refused."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_sampling_schema)

    model: Text | None = None
    n: IntIn(RANGES["n"].low, MAX_N) = 1
    temperature: Number | None = sampling_float("temperature", None)
    top_p: Number | None = sampling_float("top_p", None)
    top_k: SamplingInt("top_k") | None = None
    min_p: Number | None = sampling_float("min_p", None)
    seed: SamplingInt("seed") | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None  # "" is refused (as vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Number = sampling_float("frequency_penalty", 0.0)
    presence_penalty: Number = sampling_float("presence_penalty", 0.0)
    repetition_penalty: Number | None = sampling_float("repetition_penalty", None)  # vLLM's
    # token id (a string in JSON) -> bias, clamped to [-100, 100]
    logit_bias: dict[str, Annotated[Number, Field(**LOGIT_BIAS.bounds())]] | None = Field(
        default=None, json_schema_extra={"propertyNames": {"pattern": r"^\s*\+?[0-9]+\s*$"}}
    )
    allowed_token_ids: TokenIds | None = None  # vLLM's extension
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    truncate_prompt_tokens: Literal[-1] | SamplingInt("truncate_prompt_tokens") | None = None
    ignore_eos: bool = False
    min_tokens: SamplingInt("min_tokens") = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: Text | None = None
    bad_words: list[Word] | None = None  # vLLM's: never generated
    # vLLM's: thinking tokens before the reasoning parser's end tag is forced (--reasoning-parser)
    thinking_token_budget: SamplingInt("thinking_token_budget") | None = None
    # vLLM's: lower first, with --scheduling-policy priority
    priority: IntIn(INT64_MIN, INT64_MAX) = 0
    # output constraints: vLLM's body and its older fields (`structured.py`)
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true (as OpenAI "
                             "and vLLM answer)")  # fmt: skip
        return self

    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field asking for something this engine cannot do, or None."""
        return unknown_field(self.model_extra)

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """`defaults` (the model's generation config) fill the sampling fields the request
        left out; then SamplingParams' own defaults."""
        field = self.unsupported()
        if field is not None:
            raise ValueError(f"{field} is not supported by this server")
        sampling = {k: v for k, v in (defaults or {}).items() if k in _DEFAULTABLE}
        sampling.update({k: getattr(self, k) for k in _DEFAULTABLE if getattr(self, k) is not None})
        return SamplingParams(
            structured_outputs=structured_outputs(self),
            bad_words=self.bad_words,
            n=self.n,
            **sampling,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            # OpenAI's range for a bias is [-100, 100]; vLLM clamps to it too
            logit_bias=None
            if self.logit_bias is None
            else {k: min(max(v, -100.0), 100.0) for k, v in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            thinking_token_budget=self.thinking_token_budget,
            output_kind=RequestOutputKind.DELTA,
        )


# ---- requests ------------------------------------------------------------------------------


def _completion_schema(schema: dict[str, Any]) -> None:
    _sampling_schema(schema)
    schema["properties"]["suffix"] = {"enum": ["", None]}  # unsupported: refused when set


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_completion_schema)

    # a text, texts, token ids, or lists of token ids (OpenAI's forms), none of them empty
    prompt: NonEmptyText | Prompts[NonEmptyText] | TokenIds | Prompts[TokenIds]
    max_tokens: SamplingInt("max_tokens") | None = 16
    echo: bool = False
    logprobs: IntIn(RANGES["logprobs"].low, MAX_LOGPROBS) | None = None
    suffix: str | None = None
    best_of: IntIn(0, INT32_MAX) | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of > self.n:
            return "best_of"
        return super().unsupported()


class TextPart(RequestModel):
    """A content part: only text ones are understood."""

    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    """A message; every role but the assistant's needs content (a string or text parts)."""

    model_config = ConfigDict(
        extra="allow",  # e.g. `name`: for the chat template
        strict=True,
        json_schema_extra={
            "anyOf": [
                {"properties": {"role": {"const": "assistant"}}},
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            ]
        },
    )
    role: Role
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")  # an assistant's null content
        if message.get("tool_calls"):  # templates take arguments as objects, as vLLM gives
            if not isinstance(message["tool_calls"], list):
                raise ValueError("tool_calls must be a list of calls")
            message["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
        return message


def _template_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError('tool_calls: each call must be {"function": {"name", "arguments"}}')
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            raise ValueError(f"tool_calls arguments must be JSON, got {arguments!r}") from None
    return {**call, "function": function}


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_chat_schema)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: SamplingInt("max_tokens") | None = None
    max_completion_tokens: SamplingInt("max_tokens") | None = None
    logprobs: bool = False
    top_logprobs: IntIn(RANGES["logprobs"].low, MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a function
    parallel_tool_calls: bool = True  # false: at most one call (OpenAI's, vLLM's)
    chat_template: str | None = None  # vLLM's: instead of the model's (or --chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # OpenAI's field (gpt-oss: "Reasoning: low" in its system message): the template's
    # `reasoning_effort` variable, as vLLM gives it, unless chat_template_kwargs sets one
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""

    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra=_one_of(("prompt", {}), ("messages", {}))
    )

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # prompts only: a chat template adds its own
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # rendered by the template as in a chat request
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[TokenId]
