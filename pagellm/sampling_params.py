"""SamplingParams: how to pick tokens and when to stop, with vLLM's names and defaults.

A msgspec Struct, so it crosses the process boundary as msgpack without pickling.
Invalid values raise ValueError naming the field, before a request reaches the engine: a value
of the wrong type (a float for an integer, a string for a bool) as well as one out of range.
Every range stops at what the engine holds (int32 counts, int64 seeds and ids, finite float32
settings), so a value that validates can always be run. The ranges are data (`RANGES`): the
server's request schema declares the same bounds from them (`entrypoints/openai/protocol.py`).
What depends on the model (token ids in its vocabulary, logprob counts within max_logprobs)
is `verify_for_model`, which the input processor calls once the model is known.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any, NamedTuple

import msgspec

from pagellm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


class Range(NamedTuple):
    """The values a numeric field may take: [low, high], or (low, high] with `low_open`."""

    low: int | float
    high: int | float
    low_open: bool = False
    note: str = ""  # what a special value means, for the error message

    def __contains__(self, value: object) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def text(self) -> str:
        if self.high == FLOAT32_MAX and self.low == 0:  # a float with a lower bound only
            return "greater than zero" if self.low_open else "non-negative"
        interval = f"{'(' if self.low_open else '['}{self.low}, {self.high}]"
        return f"in {interval}" + (f" ({self.note})" if self.note else "")

    def bounds(self) -> dict[str, int | float]:
        """As pydantic's Field arguments (gt / ge, le)."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}


# every numeric field's range (None, where a field allows it, is not checked against it)
RANGES: dict[str, Range] = {
    "n": Range(1, INT32_MAX),
    "temperature": Range(0, FLOAT32_MAX),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, INT32_MAX, note="-1 or 0: no top-k"),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, FLOAT32_MAX, low_open=True),
    "seed": Range(INT64_MIN, INT64_MAX),
    "max_tokens": Range(1, INT32_MAX),
    "min_tokens": Range(0, INT32_MAX),
    "logprobs": Range(0, INT32_MAX),
    "prompt_logprobs": Range(0, INT32_MAX),
    "truncate_prompt_tokens": Range(1, INT32_MAX, note="or -1: the model's length"),
    "thinking_token_budget": Range(0, INT32_MAX, note="0: close the thinking at once"),
}
TOKEN_ID = Range(0, INT64_MAX)  # any vocabulary's; `verify_for_model` checks the model's
LOGIT_BIAS = Range(-FLOAT32_MAX, FLOAT32_MAX)  # a bias: any finite float32

# field -> whether None is allowed; checked (and numpy scalars made Python ones) before ranges
_INT_FIELDS = {
    "n": False,
    "top_k": False,
    "min_tokens": False,
    "max_tokens": True,
    "seed": True,
    "logprobs": True,
    "prompt_logprobs": True,
    "truncate_prompt_tokens": True,
    "thinking_token_budget": True,
}
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every RequestOutput holds all text and tokens so far
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


_OUTPUT_KINDS = {kind.value for kind in RequestOutputKind}


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0  # minus this, once, for every token already in the output
    frequency_penalty: float = 0.0  # minus this per occurrence in the output
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / r (> 0) or * r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob + top k
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, ...
    bad_words: list[str] | None = None  # never generated (as vLLM: with and without a space)
    # bad_words as token id sequences, filled by the engine's input processor
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: at most this many tokens of thinking, then the reasoning parser's end tag is
    # forced (the engine needs a reasoning_parser)
    thinking_token_budget: int | None = None
    # the reasoning parser's (start tag, end tag) as token ids, filled by the input processor
    reasoning_tag_ids: tuple[list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        self._normalize_types()
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _normalize_types(self) -> None:
        """Wrong types are ValueErrors naming the field; numbers become plain ints / floats,
        `stop` a list of strings, token-id lists lists of ints, logit_bias {int: float}."""
        for name, optional in _INT_FIELDS.items():
            setattr(self, name, _as_int(name, getattr(self, name), optional))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be a bool, got {_show(value)}")
        self.stop = _as_strings("stop", self.stop)
        self.stop_token_ids = _as_token_ids("stop_token_ids", self.stop_token_ids) or []
        self.allowed_token_ids = _as_token_ids("allowed_token_ids", self.allowed_token_ids)
        self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.bad_words is not None:
            self.bad_words = _as_strings("bad_words", self.bad_words)
        if self.bad_words_token_ids is not None:
            ids = self.bad_words_token_ids
            ok = isinstance(ids, (list, tuple))
            _check(ok, "bad_words_token_ids", "must be a list of token id lists")
            self.bad_words_token_ids = [_as_token_ids("bad_words_token_ids", w) for w in ids]
        if self.reasoning_tag_ids is not None:
            tags = self.reasoning_tag_ids
            ok = isinstance(tags, (list, tuple)) and len(tags) == 2
            _check(ok, "reasoning_tag_ids", "must be (start tag ids, end tag ids)")
            start, end = (_as_token_ids("reasoning_tag_ids", t) for t in tags)
            _check(bool(start and end), "reasoning_tag_ids", "must not hold an empty tag")
            self.reasoning_tag_ids = (start, end)
        structured = self.structured_outputs
        ok = structured is None or isinstance(structured, StructuredOutputsParams)
        expected = f"must be StructuredOutputsParams, got {_show(structured)}"
        _check(ok, "structured_outputs", expected)
        kind = self.output_kind
        ok = isinstance(kind, int) and not isinstance(kind, bool) and kind in _OUTPUT_KINDS
        _check(ok, "output_kind", f"must be a RequestOutputKind, got {_show(kind)}")
        self.output_kind = RequestOutputKind(kind)

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def _verify(self) -> None:
        """Ranges (`RANGES`), then what ties fields together or is not a number."""
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is None or (name == "truncate_prompt_tokens" and value == -1):
                continue
            _check(value in allowed, name, f"must be {allowed.text()}, got {value}")
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty",
        )
        _check(
            self.bad_words is None or all(w.strip() for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        _check(all(s for s in self.stop), "stop", "cannot contain an empty string")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """What depends on the model: token ids of its vocabulary, and logprob counts within
        max_logprobs (a top-k wider than the vocabulary would fail in the engine, for every
        request of the step)."""
        _check_in_vocab(self.logit_bias or {}, vocab_size, "logit_bias")
        _check_in_vocab(self.allowed_token_ids or [], vocab_size, "allowed_token_ids")
        _check_in_vocab(self.stop_token_ids, vocab_size, "stop_token_ids")
        limit = min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > limit:
                raise ValueError(
                    f"SamplingParams.{name}={k} is more than the {limit} allowed "
                    "(max_logprobs, at most the vocabulary size)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")


def _check_in_vocab(token_ids: Any, vocab_size: int, field: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"SamplingParams.{field}: token id {bad} is out of vocabulary (vocab size {vocab_size})"
        )


def _show(value: Any) -> str:
    """A value for an error message: its type and a bounded repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _as_int(field: str, value: Any, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    _check(ok, field, f"must be an integer, got {_show(value)}")
    return int(value)


def _as_float(field: str, value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _check(ok, field, f"must be a number, got {_show(value)}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    _check(abs(value) <= FLOAT32_MAX, field, f"must be a finite number, got {value}")
    return value


def _as_strings(field: str, value: Any) -> list[str]:
    """None, a string or a list of strings -> a list of strings that UTF-8 can carry."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    _check(isinstance(items, (list, tuple)), field, "must be a string or a list of strings")
    for item in items:
        _check(isinstance(item, str), field, f"must hold strings, got {_show(item)}")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"SamplingParams.{field} must be valid Unicode, got {item!r} (a lone surrogate)"
            ) from None
    return list(items)


def _as_token_ids(field: str, value: Any) -> list[int] | None:
    if value is None:
        return None
    _check(isinstance(value, (list, tuple)), field, "must be a list of token ids")
    ids = [_as_int(field, t) for t in value]
    bad = next((t for t in ids if t not in TOKEN_ID), None)
    _check(bad is None, field, f"has token id {bad}, outside any vocabulary")
    return ids


def _as_logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias}; JSON gives the ids as strings ("50256")."""
    if value is None:
        return None
    _check(isinstance(value, dict), "logit_bias", "must map token ids to numbers")
    bias = {}
    for key, v in value.items():
        if isinstance(key, str) and key.strip().lstrip("+-").isdigit():
            key = int(key)
        token_id = _as_int("logit_bias", key)
        ok = token_id in TOKEN_ID
        _check(ok, "logit_bias", f"has token id {token_id}, outside any vocabulary")
        bias[token_id] = _as_float("logit_bias", v)
    return bias
