"""POST /v1/chat/completions: messages through the model's chat template -> assistant replies.

Without `max_tokens` / `max_completion_tokens` a reply may fill the context. `logprobs: true`
with `top_logprobs: N` returns OpenAI's chat logprobs (`content`: one entry per token).
A stream starts each choice with a `role` delta and may end with a usage chunk
(`stream_options.include_usage`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.input_processor import render_chat
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from pagellm.entrypoints.openai.serving_engine import (
    Generation,
    OpenAIServing,
    gather_choices,
    random_id,
    usage,
)
from pagellm.outputs import CompletionOutput, Logprob


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        model = self.model_name(request.model)
        prompt = self._render(request)
        prompt_ids = self.truncated(request, self.encode(prompt))
        requested = request.max_completion_tokens or request.max_tokens
        params = request.to_sampling_params(
            self.max_tokens(len(prompt_ids), requested),
            self._num_logprobs(request),
            defaults=self.default_sampling_params,
        )
        request_id = random_id("chatcmpl")
        generation = self.start(
            [{"prompt": prompt, "prompt_token_ids": prompt_ids}], [params], request_id
        )
        if request.stream:
            events = self._stream_events(request, model, request_id, len(prompt_ids), generation)
            return await self.stream(raw_request, generation, events)
        outputs = await self.collect(raw_request, generation)
        return JSONResponse(
            self._response(request, model, request_id, len(prompt_ids), outputs).model_dump()
        )

    def _render(self, request: ChatCompletionRequest) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        messages = [m.to_template_dict() for m in request.messages]
        return render_chat(self.tokenizer, messages, request.add_generation_prompt)

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
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=state.text),
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        num_generated = sum(len(out.token_ids) for _, o in outputs for out in o.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage(num_prompt_tokens, num_generated),
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
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

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
        async for _, out in generation.outputs():
            for completion in out.outputs:
                num_generated += len(completion.token_ids)
                choice = self._stream_choice(request, completion)
                if choice is not None:
                    yield chunk([choice])
        if request.include_usage:
            yield chunk([], usage=usage(num_prompt_tokens, num_generated))

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatStreamChoice | None:
        if not completion.text and completion.finish_reason is None and not completion.token_ids:
            return None
        logprobs = None
        if request.logprobs:
            logprobs = self._logprobs(
                completion.token_ids, completion.logprobs or [], request.top_logprobs
            )
        return ChatStreamChoice(
            index=completion.index,
            delta=DeltaMessage(content=completion.text),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
