"""SamplingParams: how to pick tokens and when to stop, with vLLM's names and defaults.

A msgspec Struct, so it crosses the process boundary as msgpack without pickling.
Invalid values raise ValueError naming the field, before a request reaches the engine.
"""

from __future__ import annotations

import enum
import math

import msgspec

from pagellm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every RequestOutput holds all text and tokens so far
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON gives string keys: "50256" -> 50256
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(
                    "SamplingParams.logit_bias must map token ids to numbers, "
                    f"got {self.logit_bias!r}"
                ) from None
        self._verify()

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
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(
            self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disable) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            not any(math.isnan(v) for v in (self.logit_bias or {}).values()),
            "logit_bias",
            "must not contain NaN",
        )
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**64,
            "seed",
            f"must fit in 64 bits (a torch generator seed), got {self.seed}",
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
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _check(
            self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        _check(all(s for s in self.stop), "stop", "cannot contain an empty string")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative integers, got {self.stop_token_ids}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be non-negative, got {value}")
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens == -1
            or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            f"must be -1 (the model's length) or at least 1, got {self.truncate_prompt_tokens}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")
