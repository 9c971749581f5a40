"""POST /v1/chat/completions: messages through the model's chat template -> assistant replies.

Without `max_tokens` / `max_completion_tokens` a reply may fill the context. `logprobs: true`
with `top_logprobs: N` returns OpenAI's chat logprobs (`content`: one entry per token).
A stream starts each choice with a `role` delta and may end with a usage chunk
(`stream_options.include_usage`).

Tools (`tools`, `tool_choice`) go to the chat template; "auto" needs the server's
`--enable-auto-tool-choice --tool-call-parser NAME` and parses the reply, "required" and a
named function constrain it (`structured.tool_constraint`) so the call always parses. With
`--reasoning-parser` the thinking goes to `reasoning_content` (`chat_reply.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.chat_reply import ChatReply, make_reply
from pagellm.entrypoints.openai.chat_templates import ChatTemplates
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.generation import Generation, until_disconnect
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from pagellm.entrypoints.openai.response_models import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from pagellm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    api_logprob,
    count_cached,
    gather_choices,
    random_id,
    usage,
)
from pagellm.entrypoints.openai.structured import function_name, named_tool, tool_constraint
from pagellm.entrypoints.openai.tool_parsers import SPECIAL_TOKEN_PARSERS
from pagellm.outputs import CompletionOutput, Logprob
from pagellm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        *args: Any,
        templates: ChatTemplates,
        tool_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        super().__init__(*args)
        self.templates = templates
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = self.engine.config.reasoning_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        model = self.model_name(request.model)
        mode = self._tool_mode(request)
        return await self.admitted(
            request.n,
            request.stream,
            lambda release: self._create(request, raw_request, model, mode, release),
        )

    async def _create(
        self,
        request: ChatCompletionRequest,
        raw_request: Request,
        model: str,
        mode: str | None,
        release: Any,
    ) -> Response:
        prompt, prompt_ids, params = await self.prepare(request, raw_request, mode)
        request_id = random_id("chatcmpl")
        generation = self.start(
            [{"prompt": prompt, "prompt_token_ids": prompt_ids}],
            [params],
            request_id,
            request.priority,
            model=model,
        )
        if request.stream:
            events = self._stream_events(request, model, request_id, len(prompt_ids), generation)
            return await self.stream(raw_request, generation, events, release)
        outputs = await self.collect(raw_request, generation)
        return JSONResponse(
            self._response(request, model, request_id, len(prompt_ids), outputs).model_dump()
        )

    async def prepare(
        self, request: ChatCompletionRequest, raw_request: Request, mode: str | None
    ) -> tuple[str, list[int], SamplingParams]:
        """A chat request's prompt, its tokens and its sampling params (a tool_choice that
        constrains the reply as its constraint), checked as the engine would (`check`)."""
        prompt, prompt_ids = await self.render_and_encode(request, raw_request)
        prompt_ids = self.truncated(request, prompt_ids)
        requested = request.max_completion_tokens or request.max_tokens
        params = request.to_sampling_params(
            self.max_tokens(len(prompt_ids), requested),
            self._num_logprobs(request),
            defaults=self.default_sampling_params,
        )
        if {self.reasoning_parser, self.tool_parser} & set(SPECIAL_TOKEN_PARSERS):
            params = msgspec.structs.replace(params, skip_special_tokens=False)  # harmony
        if mode in ("required", "named"):
            if params.structured_outputs is not None:
                raise APIError(
                    f"tool_choice {request.tool_choice!r} constrains the reply: it cannot be "
                    "combined with response_format or another output constraint",
                    400,
                    "tool_choice",
                )
            constraint = tool_constraint(
                request.tools, request.tool_choice, request.parallel_tool_calls
            )
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        await self.check(request, [params])
        return prompt, prompt_ids, params

    async def render_and_encode(
        self,
        request: ChatCompletionRequest | TokenizeRequest,
        raw_request: Request,
        add_special_tokens: bool = True,
    ) -> tuple[str, list[int]]:
        """The prompt text (rendered in the sandbox, its render killed if the client leaves)
        and its tokens (in a worker thread: see `off_loop`)."""
        prompt = await until_disconnect(raw_request, self.templates.render(request))
        return prompt, await self.off_loop(self.encode, prompt, add_special_tokens)

    def _tool_mode(self, request: ChatCompletionRequest) -> str | None:
        """None (no tools, or "none"), "auto", "required" or "named"."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", 400, "tool_choice")
            return None
        for tool in request.tools:
            if tool.get("type") != "function" or function_name(tool) is None:
                raise APIError("tools: each tool must be a function with a name", 400, "tools")
        choice = "auto" if choice is None else choice
        if choice == "none":
            return None
        if choice == "auto":
            if not (self.enable_auto_tool_choice and self.tool_parser):
                raise APIError(
                    'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                    "and --tool-call-parser",
                    400,
                    "tool_choice",
                )
            return "auto"
        if choice == "required" or named_tool(request.tools, choice) is not None:
            return "required" if choice == "required" else "named"
        raise APIError(
            f"tool_choice must be none, auto, required or a function, got {choice!r}",
            400,
            "tool_choice",
        )

    def _reply(self, request: ChatCompletionRequest) -> ChatReply:
        mode = None if not request.tools else self._tool_mode(request)
        named = request.tool_choice["function"]["name"] if mode == "named" else None
        reply = make_reply(mode, self.tool_parser, self.reasoning_parser, named)
        reply.max_calls = None if request.parallel_tool_calls else 1
        return reply

    @staticmethod
    def _num_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.logprobs:
            return request.top_logprobs or 0
        if request.top_logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return None

    def _response(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        num_prompt_tokens: int,
        outputs: list,
    ) -> ChatCompletionResponse:
        choices = []
        for index, state in enumerate(gather_choices(outputs, request.n)):
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(state.token_ids, state.logprobs, request.top_logprobs)
            reasoning, content, calls = self._reply(request).final(state.text)
            message = ChatResponseMessage(
                content=content, reasoning_content=reasoning, tool_calls=calls
            )
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(request, state.finish_reason, calls),
                    stop_reason=state.stop_reason,
                )
            )
        num_generated = sum(len(out.token_ids) for _, o in outputs for out in o.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage(num_prompt_tokens, num_generated, count_cached({}, outputs)),
        )

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int | None
    ) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            # the sampled token comes first (rank None); by logprob, the top n come first
            ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[: top_n or 0]
            top = [self._top_logprob(tid, lp.logprob) for tid, lp in ranked]
            token = self._top_logprob(token_id, entry[token_id].logprob)
            content.append(ChatTokenLogprob(**token.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.decode_token(token_id)
        return TopLogprob(
            token=token, logprob=api_logprob(logprob), bytes=self.token_bytes(token_id)
        )

    async def _stream_events(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        num_prompt_tokens: int,
        generation: Generation,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], **extra: Any) -> str:
            return ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, **extra
            ).model_dump_json()

        for index in range(request.n):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=index, delta=role)])
        num_generated = 0
        replies = [self._reply(request) for _ in range(request.n)]
        called, cached = [False] * request.n, {}
        async for prompt_index, out in generation.outputs():
            count_cached(cached, [(prompt_index, out)])
            for completion in out.outputs:
                num_generated += len(completion.token_ids)
                choice = self._stream_choice(request, completion, replies[completion.index])
                if choice is not None:
                    called[completion.index] |= bool(choice.delta.tool_calls)
                    if choice.finish_reason is not None:
                        choice.finish_reason = _finish_reason(
                            request, choice.finish_reason, called[completion.index]
                        )
                    yield chunk([choice])
        if request.include_usage:
            cached_tokens = sum(cached.values())
            yield chunk([], usage=usage(num_prompt_tokens, num_generated, cached_tokens))

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput, reply: ChatReply
    ) -> ChatStreamChoice | None:
        if not completion.text and completion.finish_reason is None and not completion.token_ids:
            return None
        logprobs = None
        if request.logprobs:
            logprobs = self._logprobs(
                completion.token_ids, completion.logprobs or [], request.top_logprobs
            )
        reasoning, content, calls = reply.update(
            completion.text, final=completion.finish_reason is not None
        )
        delta = DeltaMessage(
            content=content if content or not (reasoning or calls) else None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
        return ChatStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _finish_reason(request: ChatCompletionRequest, reason: str | None, called: Any) -> str | None:
    """ "tool_calls" when the reply called tools and stopped by itself ("stop" for a named
    tool_choice, as OpenAI)."""
    named = isinstance(request.tool_choice, dict)
    return "tool_calls" if reason == "stop" and called and not named else reason
