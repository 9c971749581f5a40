"""`SpeculativeConfig`: vLLM's `speculative_config` keys, checked and defaulted as vLLM
defaults them (`pagellm/spec_decode/` serves them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
# a draft model's or heads' own folder: needed by these methods (mtp: the target's by default)
_SPEC_NEEDS_MODEL = ("draft_model", "eagle3")
# methods that draft with a model of their own, writing its K/V past the scheduled tokens
_SPEC_HAS_MODEL = ("draft_model", "eagle3", "mtp")
# vLLM's model-specific names of "mtp" (a checkpoint's own multi-token-prediction layers)
MTP_ALIASES = (
    "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp",
    "longcat_flash_mtp", "pangu_ultra_moe_mtp",
)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`pagellm/spec_decode/`), by vLLM's `speculative_config` keys.

    Each decoding step a proposer drafts up to `num_speculative_tokens` tokens per request and
    one forward pass verifies them. `adaptive` (pagellm's own, on by default): the drafts of a
    request follow its measured acceptance, down to none while they keep failing.
    """

    method: str
    num_speculative_tokens: int
    # the draft model (draft_model) or the heads (eagle3; mtp: None, the target's own folder)
    model: str | None = None
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix looked up
    prompt_lookup_max: int | None = None  # ngram: the longest
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None  # no drafts while more requests run
    draft_tensor_parallel_size: int | None = None  # only 1 (or the target's) is served
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method in MTP_ALIASES:
            object.__setattr__(self, "method", "mtp")
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPEC_METHODS)}, got "
                f"{self.method!r}"
            )
        _positive("num_speculative_tokens", self.num_speculative_tokens, limit=64)
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) must not exceed "
                f"prompt_lookup_max ({hi})"
            )
        _positive("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        _positive("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests)
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor must be > 0, "
                             f"got {factor!r}")  # fmt: skip
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {prob!r}")  # fmt: skip
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got "
                             f"{self.adaptive!r}")  # fmt: skip
        if self.method in _SPEC_NEEDS_MODEL and not self.model:
            raise ValueError(f"speculative_config method {self.method!r} needs 'model': the "
                             "draft model's (or heads') folder")  # fmt: skip
        if self.method not in _SPEC_HAS_MODEL and self.model is not None:
            raise ValueError(f"speculative_config method {self.method!r} takes no 'model'")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a running request holds past its scheduled tokens: a draft model writes
        its drafts' K/V there (the first k - 1 of them; one more: slack for a full accept)."""
        return self.num_speculative_tokens if self.method in _SPEC_HAS_MODEL else 0

    @classmethod
    def of(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From EngineArgs.speculative_config: a dict of vLLM's keys, its JSON text, or the
        config; defaults filled as vLLM fills them (ngram looks up 5-grams; a `model` without
        a method is a draft model; suffix drafts up to its tree depth)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                f"known: {', '.join(sorted(known))}"
            )
        value = dict(value)
        method = value.setdefault("method", "draft_model" if value.get("model") else None)
        if method in MTP_ALIASES:
            method = value["method"] = "mtp"
        if method is None:
            raise ValueError(
                f"speculative_config needs a 'method' ({', '.join(SPEC_METHODS)}) or a draft "
                "'model'"
            )
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPEC_METHODS)}, got "
                f"{method!r}"
            )
        if method == "ngram":
            lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            value["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
            value["prompt_lookup_max"] = hi if hi is not None else value["prompt_lookup_min"]
        if "num_speculative_tokens" not in value:
            default = {"ngram": 5, "suffix": value.get("suffix_decoding_max_tree_depth", 24)}
            if method not in default:
                raise ValueError(
                    f"speculative_config method {method!r} needs 'num_speculative_tokens'"
                )
            value["num_speculative_tokens"] = default[method]
        return cls(**value)


def _positive(name: str, value: Any, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
    if limit is not None and value > limit:
        raise ValueError(f"speculative_config {name} must be at most {limit}, got {value}")
