"""Pydantic models of the OpenAI API the server speaks: requests in, responses and chunks out.

Field names and defaults are OpenAI's; vLLM's extra sampling fields (`top_k`, `min_p`,
`ignore_eos`, `min_tokens`, `bad_words`, `priority`, `structured_outputs`, `guided_json`,
...) are accepted too. A field this server does not know is refused with a 400 naming it,
unless it is one of the OpenAI fields that change nothing here (`structured.IGNORED_FIELDS`);
known OpenAI features that would change the output and that this engine lacks (`suffix`,
`best_of` above `n`) are refused too. `to_sampling_params()` is where a request becomes a
`SamplingParams` (which raises ValueError for values out of range).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagellm.entrypoints.openai.structured import structured_outputs, unknown_field
from pagellm.sampling_params import RequestOutputKind, SamplingParams

MAX_LOGPROBS = 20
# OpenAI's limits: one request fans out into n x prompts engine requests, added in one go
MAX_N = 128
MAX_PROMPTS = 2048


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """The fields completions and chat share; unknown ones are kept, to be refused."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(default=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension of the OpenAI API
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    bad_words: list[str] | None = None  # vLLM's: never generated
    priority: int = 0  # vLLM's: lower first, with --scheduling-policy priority
    # output constraints: vLLM's body and its older fields (`structured.py`)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field asking for something this engine cannot do, or None."""
        return unknown_field(self.model_extra)

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        field = self.unsupported()
        if field is not None:
            raise ValueError(f"{field} is not supported by this server")
        return SamplingParams(
            structured_outputs=structured_outputs(self),
            bad_words=self.bad_words,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
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
            output_kind=RequestOutputKind.DELTA,
        )


# ---- requests ------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _few_enough_prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of > self.n:
            return "best_of"
        return super().unsupported()


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`: handed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: only text ones are understood
            message["content"] = "".join(_text_part(part) for part in self.content)
        if message.get("tool_calls"):  # templates take arguments as objects, as vLLM gives
            message.setdefault("content", "")
            message["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
        return message


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            raise ValueError(f"tool_calls arguments must be JSON, got {arguments!r}") from None
    return {**call, "function": function}


def _text_part(part: dict[str, Any]) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
    return part["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a function
    chat_template: str | None = None  # vLLM's: instead of the model's (or --chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only: a chat template adds its own
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # rendered by the template as in a chat request
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] = []


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
