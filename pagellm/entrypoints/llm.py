"""LLM: the offline facade. Builds EngineArgs, creates an LLMEngine, and runs generate()/chat().

`generate()` is the add-then-step loop: every prompt goes in with add_request(), then step()
runs until no request is unfinished, and the finished outputs come back in input order.
`generate_stream()` is the same loop as an iterator: each output as step() produces it.
`chat()` / `chat_stream()` render conversations through the chat template and split the
replies with the server's tool-call and reasoning parsers (`chat_outputs.py`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.chat_template import render_chat
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.chat_outputs import ChatParsing
from pagellm.entrypoints.llm_pooling import PoolingMethods
from pagellm.logger import ensure_library_logging
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM(PoolingMethods):
    """Offline batch generation. Takes vLLM's engine arguments by name (see EngineArgs), and
    the server's `tool_call_parser` (hermes, llama3_json, mistral, pythonic, openai) for
    `chat()`; `reasoning_parser` (qwen3, deepseek_r1, openai_gptoss) is an engine argument
    that `chat()` uses too.
    A pooling model (`runner="pooling"`) embeds, classifies and scores (`PoolingMethods`)."""

    def __init__(
        self, model: str | None = None, *, tool_call_parser: str | None = None, **kwargs: Any
    ) -> None:
        # checked before the model loads
        self.chat_parsing = ChatParsing(tool_call_parser, kwargs.get("reasoning_parser"))
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        ensure_library_logging()  # the stats line and start-up lines reach a plain script
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's defaults (its generation_config.json: temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), else vLLM's neutral ones. Used
        when `generate` / `chat` get no sampling params; start from it to change a few."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`sampling_params.structured_outputs` constrains outputs (StructuredOutputsParams);
        `priority`, one per prompt, orders waiting requests with scheduling_policy="priority"
        (lower first); `lora_request`, one for all prompts or one each (None: the base
        model), the adapter each runs with (`enable_lora=True`)."""
        prompt_list = _as_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        loras = _loras_for(prompt_list, lora_request)
        request_ids = self._add_requests(prompt_list, params_list, priority, loras=loras)
        return self._run_engine(request_ids, use_tqdm)

    def generate_stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields RequestOutputs as the engine produces them, each as its `output_kind` asks
        (CUMULATIVE, DELTA, FINAL_ONLY: then one per request, in completion order).
        Leaving the loop early aborts the requests not yet finished and frees their KV blocks."""
        prompt_list = _as_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        loras = _loras_for(prompt_list, lora_request)
        request_ids = self._add_requests(
            prompt_list, params_list, keep_output_kind=True, loras=loras
        )
        return self._stream(request_ids)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation through the chat template (`tools`: OpenAI tool definitions the
        template shows the model; `chat_template_kwargs`, e.g. {"enable_thinking": False}).
        With a reasoning parser, or a tool-call parser and `tools`, each completion's `text`
        is the reply's content and its `reasoning_content` / `tool_calls` are set, as the
        server's /v1/chat/completions message has them."""
        prompts = self._chat_prompts(
            messages, chat_template, add_generation_prompt, tools, chat_template_kwargs
        )
        params = self.chat_parsing.keep_special_tokens(self._params_for(prompts, sampling_params))
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return self.chat_parsing.final(outputs, tools)

    def chat_stream(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """`chat()` as `generate_stream()` with DELTA outputs (whatever `output_kind` says):
        each output carries the reply since the last one, its content in `text` and, with
        the parsers, its thinking in `reasoning_content` and tool-call deltas in `tool_calls`
        (the server's stream deltas). Leaving early aborts the unfinished requests."""
        prompts = self._chat_prompts(
            messages, chat_template, add_generation_prompt, tools, chat_template_kwargs
        )
        params_list = []
        kept = self.chat_parsing.keep_special_tokens(self._params_for(prompts, sampling_params))
        for params in kept:
            params = params.clone()
            params.output_kind = RequestOutputKind.DELTA
            params_list.append(params)
        loras = _loras_for(prompts, lora_request)
        request_ids = self._add_requests(prompts, params_list, keep_output_kind=True, loras=loras)
        return self.chat_parsing.deltas(self._stream(request_ids), tools)

    def _chat_prompts(
        self,
        messages: ChatMessages | list[ChatMessages],
        chat_template: str | None,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[str]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        return [
            render_chat(
                tokenizer, conv, add_generation_prompt, chat_template, tools, chat_template_kwargs
            )
            for conv in conversations
        ]

    def _params_for(
        self, prompts: list[PromptType], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts: "
                "pass one, or one per prompt"
            )
        return list(params)

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: Sequence[int] | None = None,
        keep_output_kind: bool = False,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._request_counter))
                if not keep_output_kind:
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                level = 0 if priority is None else priority[i]
                lora = None if loras is None else loras[i]
                self.llm_engine.add_request(
                    request_id, prompt, p, priority=level, lora_request=lora
                )
                added.append(request_id)
        except Exception:
            self.llm_engine.abort_request(added)  # all or nothing: the engine stays clean
            raise
        return added

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(request_ids), use_tqdm)
        try:
            for out in self._stream(request_ids):
                finished[out.request_id] = out  # FINAL_ONLY: finished outputs only
                bar.update(out)
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def _stream(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Steps the engine until these requests finish; an error, or the caller closing the
        iterator (a `break` does), aborts the unfinished ones."""
        unfinished = set(request_ids)
        try:
            while unfinished and self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        unfinished.discard(out.request_id)
                    yield out
        finally:
            if unfinished:
                self.llm_engine.abort_request(list(unfinished))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (False, changing nothing, while requests run)."""
        return self.llm_engine.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _loras_for(
    prompts: list[Any], lora: LoRARequest | Sequence[LoRARequest | None] | None
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: the one given for all, or one each."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * len(prompts)
    if len(lora) != len(prompts):
        raise ValueError(
            f"got {len(lora)} LoRA requests for {len(prompts)} prompts: pass one, or one per prompt"
        )
    return list(lora)


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)


class _ProgressBar:
    """tqdm over finished requests, with input and output tokens/s in its postfix."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = (
            tqdm(total=total, desc="Processed prompts", dynamic_ncols=True) if enabled else None
        )
        self.start = time.perf_counter()
        self.in_tokens = 0
        self.out_tokens = 0

    def update(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.in_tokens += len(out.prompt_token_ids)
        self.out_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        speed_in, speed_out = self.in_tokens / elapsed, self.out_tokens / elapsed
        self.bar.set_postfix_str(
            f"input: {speed_in:.1f} toks/s, output: {speed_out:.1f} toks/s", refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
