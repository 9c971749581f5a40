"""A request's engine work on the server: one `AsyncLLM.generate()` per prompt, each in its own
task (a `Generation`), outputs merged in one queue; `until_disconnect` awaits work unless the
client leaves first.

The HTTP handler never iterates `AsyncLLM.generate()` itself. When the client goes away, the
handler or its stream is cancelled and cancels those tasks; each `generate()` sees a plain
CancelledError and aborts its request in the engine core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

_DONE = object()  # a request's task ended normally
_START_BATCH = 32  # engine requests a Generation adds before it lets the event loop run others


class Generation:
    """One engine request per prompt, each iterated by its own task; outputs merge in a queue.
    Tasks start `_START_BATCH` at a time, so that a request with many prompts does not hold the
    event loop while it adds them all."""

    def __init__(
        self,
        engine: AsyncLLM,
        prompts: list[dict[str, Any]],
        params: list[SamplingParams],
        request_id: str,
        metrics: ServerMetrics,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.peeked: tuple[int, Any] | None = None
        self.priority = priority
        self.lora_request = lora_request  # the adapter every prompt runs with
        self.tasks: list[asyncio.Task] = []
        self.num_running = len(prompts)
        self.starter = asyncio.create_task(
            self._start_all(engine, prompts, params, request_id, metrics)
        )

    async def _start_all(
        self,
        engine: AsyncLLM,
        prompts: list[dict[str, Any]],
        params: list[SamplingParams],
        request_id: str,
        metrics: ServerMetrics,
    ) -> None:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if i and i % _START_BATCH == 0:
                await asyncio.sleep(0)  # the loop serves others between batches
            self.tasks.append(
                asyncio.create_task(self._run(engine, i, prompt, sp, f"{request_id}-{i}", metrics))
            )

    async def _run(
        self,
        engine: AsyncLLM,
        index: int,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str,
        metrics: ServerMetrics,
    ) -> None:
        timer = metrics.timer()
        try:
            lora = self.lora_request
            async for out in engine.generate(prompt, params, request_id, self.priority, lora):
                timer.on_output(out)
                self.queue.put_nowait((index, out))
        except Exception as e:
            self.queue.put_nowait((index, e))
        else:
            self.queue.put_nowait((index, _DONE))

    async def wait_first(self) -> None:
        """Waits for the first output, so that an invalid request fails before a stream starts."""
        self.peeked = await self._next()

    async def _next(self) -> tuple[int, Any]:
        while True:
            index, item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            if item is not _DONE:
                return index, item
            self.num_running -= 1
            if self.num_running == 0:
                return index, None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, DELTA output) pairs until every request is finished."""
        try:
            if self.peeked is not None:
                index, out = self.peeked
                self.peeked = None
                if out is None:
                    return
                yield index, out
            while self.num_running:
                index, out = await self._next()
                if out is not None:
                    yield index, out
        finally:
            self.cancel()

    def cancel(self) -> None:
        self.starter.cancel()
        for task in self.tasks:
            task.cancel()


async def until_disconnect(
    raw_request: Request, work: Awaitable, generation: Generation | None = None
) -> Any:
    """Awaits `work`; if the client disconnects first, cancels it and the engine requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done() or task.cancelled() or task.exception() is not None:
            task.cancel()
            if generation is not None:
                generation.cancel()
    if task not in done:
        raise APIError("the client disconnected", 499)
    return task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
