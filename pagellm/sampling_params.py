"""SamplingParams: how to pick tokens and when to stop, with vLLM's names and defaults.

A msgspec Struct, so it crosses the process boundary as msgpack without pickling.
Invalid values raise ValueError naming the field, before a request reaches the engine: a value
of the wrong type (a float for an integer, a string for a bool) as well as one out of range.
Every range stops at what the engine holds (int32 counts, int64 seeds and ids, finite float32
settings), so a value that validates can always be run.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

import msgspec

from pagellm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38

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
        self._verify_sampling()
        self._verify_lengths_and_outputs()

    def _verify_sampling(self) -> None:
        """How the next token is drawn: temperature, truncation, biases, penalties, seed."""
        _check(1 <= self.n <= INT32_MAX, "n", f"must be in [1, {INT32_MAX}], got {self.n}")
        _check(
            self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            0 <= self.top_k <= INT32_MAX,
            "top_k",
            f"must be -1 (disable) or in [1, {INT32_MAX}], got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
            "seed",
            f"must fit in a signed 64-bit integer, got {self.seed}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be greater than zero, got {self.repetition_penalty}",
        )

    def _verify_lengths_and_outputs(self) -> None:
        """How long a request runs, what stops it, what it returns besides tokens."""
        _check(
            self.max_tokens is None or 1 <= self.max_tokens <= INT32_MAX,
            "max_tokens",
            f"must be in [1, {INT32_MAX}], got {self.max_tokens}",
        )
        _check(
            0 <= self.min_tokens <= INT32_MAX,
            "min_tokens",
            f"must be in [0, {INT32_MAX}], got {self.min_tokens}",
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= INT32_MAX,
                name,
                f"must be in [0, {INT32_MAX}], got {value}",
            )
        _check(
            self.truncate_prompt_tokens in (None, -1)
            or 1 <= self.truncate_prompt_tokens <= INT32_MAX,
            "truncate_prompt_tokens",
            f"must be -1 (the model's length) or in [1, {INT32_MAX}], "
            f"got {self.truncate_prompt_tokens}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")


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
    bad = next((t for t in ids if not 0 <= t <= INT64_MAX), None)
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
        _check(
            0 <= token_id <= INT64_MAX,
            "logit_bias",
            f"has token id {token_id}, outside any vocabulary",
        )
        bias[token_id] = _as_float("logit_bias", v)
    return bias
