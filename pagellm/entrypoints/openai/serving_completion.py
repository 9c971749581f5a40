"""POST /v1/completions: prompts (text or token ids, one or many) -> text completions.

A request with several prompts and `n` completions each returns one choice per (prompt, n),
choice `i * n + j` being completion j of prompt i. `logprobs: N` returns OpenAI's legacy
logprobs object (tokens, token_logprobs, top_logprobs, text_offset); `echo` puts the prompt
in front of the text, and with `logprobs` its tokens get theirs too (the first: null).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.generation import Generation
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.entrypoints.openai.response_models import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
)
from pagellm.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    api_logprob,
    count_cached,
    gather_choices,
    random_id,
    usage,
)
from pagellm.outputs import CompletionOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.model_name(request.model)
        return await self.admitted(
            request.n * _num_prompts(request.prompt),
            request.stream,
            lambda release: self._create(request, raw_request, model, release),
        )

    async def _create(
        self, request: CompletionRequest, raw_request: Request, model: str, release: Any
    ) -> Response:
        prompts = await self.off_loop(self._prompts, request.prompt)
        for p in prompts:
            kept = self.truncated(request, p["prompt_token_ids"])
            if len(kept) < len(p["prompt_token_ids"]):
                p["prompt"], p["prompt_token_ids"] = None, kept  # echo: the kept tokens
        prompt_logprobs = request.logprobs if request.echo else None
        params = [
            request.to_sampling_params(
                self.max_tokens(len(p["prompt_token_ids"]), request.max_tokens),
                request.logprobs,
                prompt_logprobs,
                self.default_sampling_params,
            )
            for p in prompts
        ]
        await self.check(request, params)
        request_id = random_id("cmpl")
        generation = self.start(prompts, params, request_id, request.priority, model=model)
        if request.stream:
            events = self._stream_events(request, model, request_id, prompts, generation)
            return await self.stream(raw_request, generation, events, release)
        outputs = await self.collect(raw_request, generation)
        for index, out in outputs:
            _keep_prompt_logprobs(prompts[index], out.prompt_logprobs)
        choices = gather_choices(outputs, request.n)
        cached = count_cached({}, outputs)
        return JSONResponse(
            self._response(request, model, request_id, prompts, choices, cached).model_dump()
        )

    def _prompts(self, prompt: str | list) -> list[dict[str, Any]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return [self._prompt(p) for p in prompt]

    def _prompt(self, prompt: str | list[int]) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self.encode(prompt)}
        return {"prompt": None, "prompt_token_ids": prompt}

    def _prompt_text(self, prompt: dict[str, Any]) -> str:
        if prompt["prompt"] is None:
            ids = prompt["prompt_token_ids"]
            prompt["prompt"] = self.tokenizer.decode(ids) if self.tokenizer else ""
        return prompt["prompt"]

    def _response(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[dict[str, Any]],
        choices: list[ChoiceState],
        cached: int,
    ) -> CompletionResponse:
        out = []
        for index, state in enumerate(choices):
            prompt = prompts[index // request.n]
            echo = self._prompt_text(prompt) if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                echo_ids = prompt["prompt_token_ids"] if request.echo else []
                logprobs, _ = self._logprobs(
                    echo_ids, state.token_ids, state.logprobs, 0, prompt.get("prompt_logprobs")
                )
            out.append(
                CompletionChoice(
                    index=index,
                    text=echo + state.text,
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        num_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
        num_generated = sum(len(c.token_ids) for c in choices)
        return CompletionResponse(
            id=request_id,
            model=model,
            choices=out,
            usage=usage(num_prompt, num_generated, cached),
        )

    def _logprobs(
        self,
        echo_ids: list[int],
        token_ids: list[int],
        logprobs: list[dict],
        offset: int,
        prompt_logprobs: list[dict | None] | None = None,
    ) -> tuple[CompletionLogProbs, int]:
        """The logprobs object for these tokens, and the text offset of the token after them.
        Echoed prompt tokens take theirs from `prompt_logprobs` (None: none, as for the first)."""
        result = CompletionLogProbs()
        for i, token_id in enumerate(echo_ids):
            entry = prompt_logprobs[i] if prompt_logprobs else None
            offset = self._append_entry(result, token_id, entry, offset)
        for token_id, entry in zip(token_ids, logprobs):
            offset = self._append_entry(result, token_id, entry, offset)
        return result, offset

    def _append_entry(
        self, result: CompletionLogProbs, token_id: int, entry: dict | None, offset: int
    ) -> int:
        if entry is None:
            return self._append(result, token_id, None, None, offset)
        top = {self.decode_token(tid): api_logprob(lp.logprob) for tid, lp in entry.items()}
        return self._append(result, token_id, api_logprob(entry[token_id].logprob), top, offset)

    def _append(
        self,
        result: CompletionLogProbs,
        token_id: int,
        logprob: float | None,
        top: dict[str, float] | None,
        offset: int,
    ) -> int:
        token = self.decode_token(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        return offset + len(token)

    async def _stream_events(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[dict[str, Any]],
        generation: Generation,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        num_generated, cached = 0, {}
        async for prompt_index, out in generation.outputs():
            count_cached(cached, [(prompt_index, out)])
            _keep_prompt_logprobs(prompts[prompt_index], out.prompt_logprobs)
            for completion in out.outputs:
                index = prompt_index * request.n + completion.index
                num_generated += len(completion.token_ids)
                choice = self._stream_choice(
                    request, prompts[prompt_index], index, completion, offsets
                )
                if choice is not None:
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=model, choices=[choice]
                    )
                    yield chunk.model_dump_json()
        if request.include_usage:
            num_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
            chunk = CompletionResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[],
                usage=usage(num_prompt, num_generated, sum(cached.values())),
            )
            yield chunk.model_dump_json()

    def _stream_choice(
        self,
        request: CompletionRequest,
        prompt: dict[str, Any],
        index: int,
        completion: CompletionOutput,
        offsets: dict[int, int],
    ) -> CompletionChoice | None:
        first = index not in offsets
        text = completion.text
        echo_ids: list[int] = []
        if first and request.echo:
            text = self._prompt_text(prompt) + text
            echo_ids = prompt["prompt_token_ids"]
        if not text and not completion.token_ids and completion.finish_reason is None:
            return None
        logprobs, offsets[index] = None, offsets.get(index, 0)
        if request.logprobs is not None:
            logprobs, offsets[index] = self._logprobs(
                echo_ids,
                completion.token_ids,
                completion.logprobs or [],
                offsets[index],
                prompt.get("prompt_logprobs"),
            )
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _num_prompts(prompt: str | list) -> int:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def _keep_prompt_logprobs(prompt: dict[str, Any], prompt_logprobs: list | None) -> None:
    """The prompt's logprobs, from the first output that carries them (echo with logprobs)."""
    if prompt_logprobs is not None and "prompt_logprobs" not in prompt:
        prompt["prompt_logprobs"] = prompt_logprobs
