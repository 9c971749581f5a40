"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

A request becomes the chat request it amounts to (`ResponsesRequest.to_chat_request`, after the
stored conversation of `previous_response_id`), which runs as a chat completion does: the same
template render, tool modes ("auto" with the server's tool-call parser; "required" or a named
function constrain the reply), sampling params, output-constraint checks and admission
(`OpenAIServingChat.prepare`, `admitted`). The reply goes through the chat's `ChatReply` into
output items (`responses_output.py`): reasoning (with `--reasoning-parser`), a message, function
calls; a stream tells them as OpenAI's typed events. A finished response is kept
(`responses_store.py`) unless the request says `store: false`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.errors import APIError, from_exception
from pagellm.entrypoints.openai.generation import Generation
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.responses_output import ResponseRun
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest, items_to_messages
from pagellm.entrypoints.openai.responses_store import ResponseStore
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingResponses(OpenAIServingChat):
    """The chat server's template, tools, parsers and admission, with a response store."""

    def __init__(self, *args: Any, store: ResponseStore, **chat_options: Any) -> None:
        super().__init__(*args, **chat_options)
        self.store = store

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        model = self.model_name(request.model)
        conversation = self._history(request.previous_response_id) + request.input_messages()
        chat = request.to_chat_request(conversation)
        mode = self._tool_mode(chat)
        return await self.admitted(
            1,
            request.stream,
            lambda release: self._create(
                request, chat, conversation, raw_request, model, mode, release
            ),  # fmt: skip
        )

    def retrieve(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.response)

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise _not_found(previous_response_id, "previous_response_id")
        return stored.messages

    async def _create(
        self,
        request: ResponsesRequest,
        chat: ChatCompletionRequest,
        conversation: list[dict[str, Any]],
        raw_request: Request,
        model: str,
        mode: str | None,
        release: Callable[[], None],
    ) -> Response:
        prompt, prompt_ids, params = await self.prepare(chat, raw_request, mode)
        response_id = f"resp_{uuid.uuid4().hex}"
        generation = self.start(
            [{"prompt": prompt, "prompt_token_ids": prompt_ids}], [params], response_id,
            chat.priority, model=model,
        )  # fmt: skip
        skeleton = {"id": response_id, "model": model, **request.echo()}
        run = ResponseRun(skeleton, self._reply(chat), len(prompt_ids), request.stream)
        keep = _Keeper(self.store, request.store, response_id, conversation)
        if request.stream:
            events = _events(run, generation, keep)
            return await self.stream(raw_request, generation, events, release, framed=True)
        for _, out in await self.collect(raw_request, generation):
            run.add(out)
        run.finish()
        keep(run)
        return JSONResponse(run.response())


class _Keeper:
    """Stores a finished response with its conversation (unless `store` is false)."""

    def __init__(
        self, store: ResponseStore, wanted: bool, response_id: str, conversation: list[dict]
    ) -> None:
        self.store, self.wanted = store, wanted
        self.response_id, self.conversation = response_id, conversation

    def __call__(self, run: ResponseRun) -> None:
        if not self.wanted:
            return
        # a call cut off by max_output_tokens has no arguments a template could read back
        output = [
            item
            for item in run.output.items
            if item["type"] != "function_call" or item["status"] == "completed"
        ]
        messages = self.conversation + items_to_messages(output)
        self.store.put(self.response_id, run.response(), messages)


async def _events(run: ResponseRun, generation: Generation, keep: _Keeper) -> AsyncIterator[str]:
    """The typed events of a streamed response: created, in progress, each item's events,
    then completed or incomplete (failed if the engine failed the request)."""
    yield run.started()
    try:
        async for _, out in generation.outputs():
            run.add(out)
            frames = run.output.drain()
            if frames:
                yield frames
    except Exception as e:  # the status line is out: the stream says it failed
        error = from_exception(e)
        yield run.failed(error.status, error.message)
        return
    frames = run.ended()
    keep(run)
    yield frames


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        f"no response with id {response_id!r} is stored on this server (it was never stored, "
        "was created with store false, or was dropped: --responses-store-max, "
        "--responses-store-ttl)",
        404,
        param,
    )
