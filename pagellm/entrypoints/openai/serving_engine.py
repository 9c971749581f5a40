"""What completions and chat share: the model-name check, the context-length check, admission
(a bound on queued work, held while a request runs: `admitted`), tokenizing off the event loop,
running one engine request per prompt (a `Generation`, generation.py), and answering as JSON
or as server-sent events.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.input_processor import check_structured_outputs, truncate_prompt
from pagellm.entrypoints.openai.constraint_checks import ConstraintChecks
from pagellm.entrypoints.openai.errors import APIError, from_exception, too_busy, unavailable
from pagellm.entrypoints.openai.generation import Generation, until_disconnect
from pagellm.entrypoints.openai.lora_adapters import LoRAAdapters
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.protocol import SamplingRequest
from pagellm.entrypoints.openai.response_models import PromptTokensDetails, UsageInfo
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def api_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: a token the sampling masks ruled out (-inf; NaN when
    every token was) is -9999.0, as vLLM reports it."""
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB


_MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoiceState:
    """One choice's text, tokens and logprobs, gathered from DELTA outputs."""

    __slots__ = ("texts", "token_ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.texts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs:
            self.logprobs.extend(completion.logprobs)
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Admission:
    """Bounds the engine requests (n x prompts each) the server holds, from before their
    prompts are tokenized until their responses end: beyond the limit, 429 with Retry-After.
    One request over the limit on its own could never run: 400."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def acquire(
        self, cost: int, what: str = "completions (n x prompts)", param: str | None = "n"
    ) -> Callable[[], None]:
        """Holds `cost` engine requests (`what`, the request field to blame if they can never
        fit); returns the (idempotent) release."""
        if cost > self.limit:
            raise APIError(
                f"this request asks for {cost} {what}, more than this server "
                f"queues ({self.limit}: --max-num-seqs + --max-waiting-requests)",
                400,
                param,
            )
        if self.in_use + cost > self.limit:
            raise too_busy(
                f"the server is busy ({self.in_use} of {self.limit} requests queued or running); "
                "retry later"
            )
        self.in_use += cost
        held = [cost]

        def release() -> None:
            self.in_use -= held.pop() if held else 0

        return release


def gather_choices(outputs: list[tuple[int, RequestOutput]], n: int) -> list[ChoiceState]:
    """Choice `i * n + j` is completion j of prompt i, as OpenAI numbers them."""
    choices: dict[int, ChoiceState] = {}
    for index, out in outputs:
        for completion in out.outputs:
            choices.setdefault(index * n + completion.index, ChoiceState()).add(completion)
    return [choices[k] for k in sorted(choices)]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def count_cached(cached: dict[int, int], outputs: Iterable[tuple[int, RequestOutput]]) -> int:
    """Prompt tokens served from the prefix cache, over the prompts: each prompt's count
    (`num_cached_tokens`) as its latest output in `cached` (prompt index -> count) says it;
    with n > 1 the latest counts every completion (see RequestOutput)."""
    for index, out in outputs:
        cached[index] = out.num_cached_tokens
    return sum(cached.values())


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        model_names: list[str],
        metrics: ServerMetrics,
        admission: Admission | None = None,
    ) -> None:
        self.engine = engine
        self.model_names = model_names
        self.metrics = metrics
        self.admission = admission or Admission(1 << 30)
        self.constraints: ConstraintChecks | None = None  # set by the server
        self.loras: LoRAAdapters | None = None  # the server's LoRA adapters by name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model_config.max_model_len
        self._token_bytes: dict[int, list[int]] = {}
        tokenizer = self.tokenizer
        self.special_ids = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel" in str(backend.decoder)

        # generation_config.json's defaults for what a request leaves out (vLLM's name)
        self.default_sampling_params = engine.config.model_config.default_sampling_params

    def admit(
        self, cost: int, what: str = "completions (n x prompts)", param: str | None = "n"
    ) -> Callable[[], None]:
        """Room for `cost` engine requests (see Admission), while the engine runs."""
        if self.engine.errored:
            raise unavailable(f"the engine is not running: {self.engine.dead_error}")
        return self.admission.acquire(cost, what, param)

    async def admitted(
        self,
        cost: int,
        stream: bool,
        create: Callable[[Callable[[], None]], Awaitable[Response]],
    ) -> Response:
        """`create(release)` holding room for `cost` engine requests: released when it fails
        or returns, but a stream's only when the stream ends (`stream` calls `release`)."""
        release = self.admit(cost)
        try:
            response = await create(release)
        except BaseException:
            release()
            raise
        if not stream:
            release()
        return response

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.model_names or requested in (self.loras or ()):
            return requested or self.model_names[0]
        raise APIError(f"The model `{requested}` does not exist.", 404, "model")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (in a worker thread: see `off_loop`)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompts as token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the tokenizer's own message would not say so
            message = f"the prompt is not valid Unicode (a lone surrogate at {e.start})"
            raise ValueError(message) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @staticmethod
    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizing or rendering a template: in a worker thread, never on the event loop
        (the tokenizers library releases the GIL, so the loop keeps serving meanwhile)."""
        return await asyncio.to_thread(fn, *args)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's logprob `bytes`): a byte-fallback token `<0xF0>` or
        a byte-level BPE piece of a split character is that byte, not U+FFFD's three."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = list(_raw_token_bytes(self, token_id))
        return cached

    def truncated(self, request: SamplingRequest, prompt_ids: list[int]) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: max_model_len), if set."""
        return truncate_prompt(prompt_ids, request.truncate_prompt_tokens, self.max_model_len)

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int | None:
        """The requested max_tokens, or the room left (at most the generation config's
        max_new_tokens); an APIError past the context."""
        room = self.max_model_len - num_prompt_tokens
        if requested is not None and requested < 1:
            return requested  # SamplingParams says what is wrong with it
        default = self.default_sampling_params.get("max_tokens")
        if requested is None and default is not None and room >= 1:
            return min(default, room)
        wanted = room if requested is None else requested
        if wanted > room or room < 1:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max(wanted, 1)} tokens "
                f"({num_prompt_tokens} in the prompt, {max(wanted, 1)} for the completion). "
                "Please reduce the length of the prompt or of the completion.",
                400,
                "max_tokens" if requested is not None and room >= 1 else "prompt",
            )
        return wanted

    async def check(self, request: SamplingRequest, params: list[SamplingParams]) -> None:
        """What the engine would refuse later, refused now: a priority without the priority
        policy, a thinking budget without a reasoning parser, a constraint over a limit, that
        does not parse or compile, or that matches nothing (`constraints`: the server's
        sandboxed check; without it, the check without the compile off the event loop, cached
        for the engine's own)."""
        if request.priority and self.engine.config.scheduler_config.policy != "priority":
            raise APIError(
                "priority needs the server started with --scheduling-policy priority",
                400,
                "priority",
            )
        if request.thinking_token_budget is not None and not self.engine.config.reasoning_parser:
            raise APIError(
                "thinking_token_budget needs the server started with --reasoning-parser (to "
                "know where the thinking ends)",
                400,
                "thinking_token_budget",
            )
        constraint = params[0].structured_outputs if params else None
        if constraint is None:
            return
        if self.constraints is not None:  # the server: in a sandbox process, compile included
            await self.constraints.check(constraint.key())
        else:
            limits = self.engine.config.structured_outputs_config
            await asyncio.to_thread(check_structured_outputs, constraint.key(), limits)

    def start(
        self,
        prompts: list[dict[str, Any]],
        params: list[SamplingParams],
        request_id: str,
        priority: int = 0,
        model: str | None = None,
    ) -> Generation:
        """`model`: the request's model name (a LoRA adapter's: its requests run with it)."""
        lora = None if self.loras is None else self.loras.request_for(model)
        if lora is None and model is not None and model not in self.model_names:
            # its adapter was unloaded while the prompt was prepared (after `model_name`):
            # never answer from the base model under the adapter's name
            raise APIError(f"The model `{model}` does not exist.", 404, "model")
        return Generation(self.engine, prompts, params, request_id, self.metrics, priority, lora)

    async def collect(
        self, raw_request: Request, generation: Generation
    ) -> list[tuple[int, RequestOutput]]:
        """Every output of a non-streaming request; the request is aborted if the client leaves."""
        return await until_disconnect(raw_request, _collect(generation), generation)

    async def stream(
        self,
        raw_request: Request,
        generation: Generation,
        events: AsyncIterator[str],
        release: Callable[[], None],
        framed: bool = False,
    ) -> StreamingResponse:
        """Server-sent events; errors before the first output still get an HTTP status.
        `release` (the admission) is called when the stream ends. `events` yields each event's
        data, or (`framed`: the Responses API's typed events) whole frames, with no `[DONE]`."""
        await until_disconnect(raw_request, generation.wait_first(), generation)
        frames = _sse(events, generation, release, framed)
        return StreamingResponse(frames, media_type="text/event-stream")


async def _collect(generation: Generation) -> list[tuple[int, RequestOutput]]:
    return [item async for item in generation.outputs()]


async def _sse(
    events: AsyncIterator[str],
    generation: Generation,
    release: Callable[[], None],
    framed: bool = False,
) -> AsyncIterator[str]:
    try:
        async for data in events:
            yield data if framed else f"data: {data}\n\n"
    except Exception as e:  # the status line is already out: report the error in the stream
        yield f"data: {from_exception(e).to_response().model_dump_json()}\n\n"
    finally:
        generation.cancel()
        release()
    if not framed:
        yield "data: [DONE]\n\n"


def _raw_token_bytes(serving: OpenAIServing, token_id: int) -> bytes:
    """A token's bytes from its vocabulary entry: `<0xF0>` (byte fallback), a byte-level BPE
    piece (each byte spelt as one character) or a SentencePiece piece ("▁" for a space);
    special tokens and anything else as their decoded text."""
    tokenizer = serving.tokenizer
    piece = None if tokenizer is None else tokenizer.convert_ids_to_tokens(token_id)
    if piece is None or token_id in serving.special_ids:
        return serving.decode_token(token_id).encode("utf-8")
    byte = _BYTE_TOKEN.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    if serving.byte_level and all(ch in _UNICODE_TO_BYTE for ch in piece):
        return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the others
    (controls, space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return mapping


_UNICODE_TO_BYTE = _unicode_to_byte()
