"""InputProcessor: a prompt (text, token ids or chat messages) -> a validated EngineCoreRequest.

Every error a user can cause is raised here, before anything reaches the engine core, as a
ValueError that says what is wrong and what the limit is. Sampling settings are checked by
`SamplingParams` itself (its ranges when it is made, the model's limits in
`verify_for_model`, called here).
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from pagellm.config import REASONING_TAGS, ModelConfig, StructuredOutputsConfig
from pagellm.config.lora import LoRAConfig
from pagellm.engine.lora_check import LoRACheck
from pagellm.loader.source import TOKENIZER_FILES
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.protocol import EngineCoreRequest
from pagellm.sampling_params import RequestOutputKind, SamplingParams

# a prompt: text, or vLLM's TextPrompt {"prompt": str} / TokensPrompt {"prompt_token_ids": [...]}
PromptType = str | dict[str, Any]
# a pooling request's placeholder: its prompt is computed, one "token" ends it, none is sampled
_PREFILL_ONLY = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any | None,
        structured_outputs_config: StructuredOutputsConfig | None = None,
        reasoning_parser: str | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.check_lora = LoRACheck(model_config, lora_config)
        self.tokenizer = tokenizer
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.eos_token_ids = eos_token_ids(model_config, tokenizer)
        self.reasoning_parser = reasoning_parser
        self._reasoning_tag_ids: tuple[list[int], list[int]] | None = None  # once tokenized

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Returns the prompt text (None for token-id prompts) and the request for the core."""
        lora_request = self.check_lora(lora_request)  # a Hub id's: its snapshot folder
        pooling = self.model_config.pooler_config
        if isinstance(params, PoolingParams) or pooling is not None:
            return self._process_pooling(request_id, prompt, params, arrival_time, priority)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        token_ids = truncate_prompt(
            token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len
        )
        self._validate(token_ids)
        params.verify_for_model(self.model_config.vocab_size, self.model_config.max_logprobs)
        if params.structured_outputs is not None:
            key = params.structured_outputs.key()
            check_structured_outputs(key, self.structured_outputs_config)
        if params.bad_words:
            ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = msgspec.structs.replace(params, bad_words_token_ids=ids)
        if params.thinking_token_budget is not None or params.reasoning_tag_ids is not None:
            params = self._with_reasoning_tags(params)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            lora_request=lora_request,
        )
        return text, request

    def _process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
    ) -> tuple[str | None, EngineCoreRequest]:
        """A pooling model's request (embed, classify, score): prefill-only, no sampling."""
        mc = self.model_config
        if mc.pooler_config is None:
            raise ValueError(
                f"{mc.model!r} is a generative model: embed, classify and score need a "
                "pooling model (LLM(..., runner='pooling'))"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{mc.model!r} is a pooling model: it embeds, classifies or scores "
                "(LLM.embed / classify / score), it does not generate"
            )
        pc = mc.pooler_config
        size = pc.embedding_size or mc.hf_config.hidden_size  # after Dense modules: theirs
        params.verify_for_model(pc.task, size, pc.matryoshka, pc.matryoshka_dimensions,
                                mc.model)  # fmt: skip
        keep = params.truncate_prompt_tokens
        keep = mc.max_model_len if keep == -1 else keep
        if keep is not None and keep > mc.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({keep}) is more than the maximum model length "
                f"({mc.max_model_len}): pass at most that, or -1"
            )
        text, token_ids = self._pooling_tokens(prompt, keep)
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is not None:  # a pair's (LLM.score)
            params = msgspec.structs.replace(params, token_type_ids=self._types(types, token_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=_PREFILL_ONLY,
            eos_token_ids=[],
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            pooling_params=params,
        )
        return text, request

    def _pooling_tokens(self, prompt: PromptType, keep: int | None) -> tuple[str | None, list[int]]:
        """A pooling prompt's text and ids: text as sentence-transformers reads it (lowercased
        with do_lower_case) and truncated by the tokenizer to `keep` tokens; ids to their
        last `keep`."""
        mc = self.model_config
        if isinstance(prompt, str):
            prompt = mc.pooler_config.st_text(prompt)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            prompt = {**prompt, "prompt": mc.pooler_config.st_text(prompt["prompt"])}
        text, token_ids = self._tokenize(prompt, keep)
        from_text = not (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        if keep is not None and from_text and len(token_ids) > keep:  # HF could not truncate
            raise ValueError(
                f"truncate_prompt_tokens ({keep}) is fewer than the tokenizer's special tokens "
                f"({self.tokenizer.num_special_tokens_to_add()}): pass more, or -1"
            )
        if keep is not None:  # token ids: the last ones, as truncate_prompt tokens them
            token_ids = truncate_prompt(token_ids, keep, mc.max_model_len)
        self._validate(token_ids, "pass truncate_prompt_tokens to truncate it")
        return text, token_ids

    def _types(self, types: Any, token_ids: list[int]) -> list[int]:
        """A pair's token types: as many as its ids (which it ends with), each in the model's
        table (an index past it would fail the whole step)."""
        types = _as_prompt_token_ids(types)[-len(token_ids) :]
        if len(types) != len(token_ids):
            raise ValueError(f"token_type_ids: {len(types)} for {len(token_ids)} prompt tokens")
        n_types = getattr(self.model_config.hf_config, "type_vocab_size", None)
        if n_types is not None and not all(0 <= t < n_types for t in types):
            raise ValueError(
                f"token_type_ids must be in [0, {n_types}) (the model's type_vocab_size)"
            )
        return types

    def _with_reasoning_tags(self, params: SamplingParams) -> SamplingParams:
        """A thinking budget gets the reasoning parser's tags as token ids (the engine forces
        the end tag's); without a budget, the tags are dropped."""
        if params.thinking_token_budget is None:
            return msgspec.structs.replace(params, reasoning_tag_ids=None)
        if self.reasoning_parser is None:
            raise ValueError(
                "thinking_token_budget needs a reasoning parser to know where the thinking "
                "ends: start the server with --reasoning-parser (qwen3 | deepseek_r1), or "
                "pass LLM(reasoning_parser=...)"
            )
        if self._reasoning_tag_ids is None:
            self._reasoning_tag_ids = reasoning_tag_ids(self.tokenizer, self.reasoning_parser)
        start, end = self._reasoning_tag_ids
        check_in_vocab([*start, *end], self.model_config.vocab_size, "the reasoning tags")
        allowed = params.allowed_token_ids
        if allowed is not None and not set(end) <= set(allowed):
            raise ValueError(
                f"thinking_token_budget forces the end tag {end} when spent: allowed_token_ids "
                "must include its ids"
            )
        return msgspec.structs.replace(params, reasoning_tag_ids=(start, end))

    def _tokenize(
        self, prompt: PromptType, max_length: int | None = None
    ) -> tuple[str | None, list[int]]:
        """Text or token ids; text over `max_length` tokens truncated by the tokenizer (its
        special tokens kept, as sentence-transformers truncates)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, max_length)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _as_prompt_token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self._encode(prompt["prompt"], max_length)
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def _encode(self, text: str, max_length: int | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"this model has no tokenizer ({self.model_config.source.path} has none of "
                f"{', '.join(TOKENIZER_FILES)}): pass tokenizer=..., or prompts as "
                "{'prompt_token_ids': [...]}"
            )
        if max_length is not None:
            return self.tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        return self.tokenizer.encode(text)

    def _validate(self, token_ids: list[int], how_to_shorten: str | None = None) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty: it must have at least one token")
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"The prompt (length {len(token_ids)}) is longer than the maximum model "
                f"length of {max_len} tokens" + (f": {how_to_shorten}" if how_to_shorten else "")
            )
        check_in_vocab(token_ids, self.model_config.vocab_size)


@functools.lru_cache(maxsize=1024)
def check_structured_outputs(key: tuple[str, str], limits: StructuredOutputsConfig) -> None:
    """ValueError naming the problem if a constraint (StructuredOutputsParams.key()) is over a
    limit, is not a valid schema, regex or grammar, or matches no string (the validator's steps
    without the vocabulary: `structured_output/validator.py`); valid keys are remembered. The
    first call imports xgrammar (seconds): a server calls this off its event loop."""
    from pagellm.structured_output.validator import validate

    validate(key, limits)


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, as it starts a text and after a space (" word"), as vLLM
    bans them; the spaced form only where it tokenizes differently."""
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer; this model has none")
    sequences: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def reasoning_tag_ids(tokenizer: Any, reasoning_parser: str) -> tuple[list[int], list[int]]:
    """The parser's start and end tags as the model's tokenizer writes them (a tag that is not
    one token is a sequence of ids)."""
    if tokenizer is None:
        raise ValueError("thinking_token_budget needs a tokenizer; this model has none")
    tags = REASONING_TAGS[reasoning_parser]
    start, end = (tokenizer.encode(tag, add_special_tokens=False) for tag in tags)
    if not start or not end:
        raise ValueError(f"the model's tokenizer writes the reasoning tags {tags} as no tokens")
    return start, end


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` tokens (vLLM's truncate_prompt_tokens; -1: max_model_len); all of them
    for None, or for a value SamplingParams refuses (0, below -1), which it reports."""
    if keep is None or keep == 0 or keep < -1:
        return token_ids
    return token_ids[-(max_model_len if keep == -1 else keep) :]


def _as_prompt_token_ids(ids: Any) -> list[int]:
    """The ids as ints; a float, a string or a bool among them is a ValueError naming the field
    (int() would turn 1.5 into 1 and "5" into 5, silently)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))  # ints, numpy and torch integers
        except TypeError:
            shown = f"{type(t).__name__} {t!r:.40}"
            raise ValueError(f"prompt_token_ids must be integers, got {shown}") from None
    return out


def check_in_vocab(token_ids: Iterable[int], vocab_size: int, owner: str | None = None) -> None:
    """ValueError naming the first id outside [0, vocab_size) (and whose ids they are)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"token id {bad} is out of vocabulary (vocab size {vocab_size})"
        raise ValueError(f"{owner}: {message}" if owner else message.capitalize())


def eos_token_ids(model_config: ModelConfig, tokenizer: Any | None) -> list[int]:
    """The tokenizer's EOS (else config.json's first), then the generation config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        first = [tokenizer.eos_token_id]
    else:
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        first = eos[:1] if isinstance(eos, list) else [] if eos is None else [eos]
    return list(dict.fromkeys([*first, *model_config.eos_token_ids]))
