"""Rotary position embedding tables, as HF computes them, for every `rope_type` we serve:

- default, linear (positions / factor), llama3 (Llama 3.1: low frequencies / factor, blended);
- yarn: NTK-by-parts blend of interpolated and original frequencies, cos/sin times
  `attention_factor` (default 0.1 ln(factor) + 1);
- dynamic (NTK): the base grows with the sequence once it passes max_position_embeddings;
- longrope (Phi-3 "su"): frequencies divided by per-dimension `short_factor`, or by
  `long_factor` past original_max_position_embeddings, cos/sin times
  sqrt(1 + ln(factor) / ln(original_max_position_embeddings)).

Tables are built on the CPU (models are built under a `meta` device context) and moved with
the model. The table has one row per position, `cos | sin` over the rotary dims (partial rotary: the
first `partial_rotary_factor * head_dim` dims of each head turn, the rest pass through).
HF decides dynamic and longrope frequencies once per forward from its longest position; a
paged engine decides per position (the row of position p is what HF uses for a token decoded
at p with its cache). For dynamic NTK the two agree for every prompt up to the original
length and every decoded token. For longrope, HF's Phi-3 rotates a sequence of more than
original_max_position_embeddings (k) tokens with the long factors throughout: a longer prompt
from its first token, and at the step where a sequence reaches k + 1 tokens its `generate`
drops the cache and recomputes every token with them. So a longrope table holds two sets of
rows, the short factors' for every position then the long factors' (`long_rope`); a request
is rotated with the second set from the step that computes its position k on (the scheduler
recomputes what it had cached, as a preemption does), and its prefix-cache blocks are keyed
apart. vLLM, which picks the long rows per batch, matches neither HF's forward nor generate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_ALIASES = {"su": "longrope"}  # Phi-3's first configs


def rope_type(scaling: dict | None) -> str:
    scaling = scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return _ALIASES.get(kind, kind)


def rope_parameters(config: Any, params: dict | None = None) -> tuple[float, dict]:
    """(theta, scaling) of a config (`rope_parameters` in transformers 5, `rope_theta` /
    `rope_scaling` before), the scaling completed with the lengths it needs. `params`
    overrides the config's own (Gemma 3: one set per layer type)."""
    if params is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    params.setdefault("max_position_embeddings", config.max_position_embeddings)
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        params.setdefault("original_max_position_embeddings", original)
    return float(theta), params


def rotary_dim(config: Any, head_dim: int) -> int:
    """The dims of a head that rotate: head_dim times `partial_rotary_factor` (Phi-3, Phi-4)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    return int(head_dim * (factor or 1.0))


def max_positions(config: Any) -> int:
    """The longest sequence the model serves: max_position_embeddings, times the factor for
    yarn (of the original length) and dynamic NTK (as vLLM derives max_model_len); RoBERTa's
    less the positions below its first (pad_token_id + 1)."""
    limit = getattr(config, "max_position_embeddings", None) or 2048
    model_type = getattr(config, "model_type", None)
    if model_type in ("roberta", "xlm-roberta"):
        return limit - (getattr(config, "pad_token_id", None) or 0) - 1  # from padding_idx + 1
    if model_type == "modernbert":  # a rotary base per layer kind, no scaling
        return limit
    _, scaling = rope_parameters(config) if hasattr(config, "max_position_embeddings") else (0, {})
    kind = rope_type(scaling)
    if kind == "yarn" and scaling.get("factor"):
        original = scaling.get("original_max_position_embeddings") or limit
        return max(limit, int(original * scaling["factor"]))
    if kind == "dynamic" and scaling.get("factor"):
        return int(limit * scaling["factor"])
    return limit


def cos_sin_table(
    dim: int, num_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """[num_positions, dim] float32: cos | sin of every position's angles (longrope: twice
    the rows, see `long_rope`)."""
    scaling = scaling or {}
    kind = rope_type(scaling)
    positions = torch.arange(num_positions, dtype=torch.float32, device="cpu")
    if kind == "dynamic":
        freqs = positions[:, None] * dynamic_inv_freq(dim, theta, scaling, positions)
        return _cos_sin(freqs, 1.0)
    if kind == "longrope":  # [2 P, dim]: the short factors' rows, then the long factors'
        factor = longrope_attention_factor(scaling)
        return torch.cat(
            [
                _cos_sin(
                    torch.outer(positions, longrope_inv_freq(dim, theta, scaling[name])), factor
                )
                for name in ("short_factor", "long_factor")
            ]
        )
    inv_freq, attention_factor = _static_inv_freq(dim, theta, scaling, kind)
    return _cos_sin(torch.outer(positions, inv_freq), attention_factor)


def _cos_sin(freqs: torch.Tensor, attention_factor: float) -> torch.Tensor:
    # freqs: [P, D/2] -> [P, D] (cos | sin), scaled as HF scales both
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def _static_inv_freq(dim: int, theta: float, s: dict, kind: str) -> tuple[torch.Tensor, float]:
    inv_freq = default_inv_freq(dim, theta)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, s), 1.0
    if kind == "yarn":
        return yarn_inv_freq(dim, theta, s), yarn_attention_factor(s)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = _arange(0, head_dim, 2).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low edge, 1 at the high edge
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def _yarn_factor(s: dict) -> float:
    return s.get("factor") or s["max_position_embeddings"] / s["original_max_position_embeddings"]


def yarn_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(s), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """Dims that turn fewer than `beta_slow` times over the original length are interpolated
    (/ factor), those turning more than `beta_fast` times kept, a linear ramp in between."""
    factor, original = _yarn_factor(s), s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = (_arange(0, dim // 2, 1).float() - low) / (high - low)
    ramp = ramp.clamp(0, 1)
    pos_freqs = theta ** (_arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # the weight of the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def dynamic_inv_freq(
    dim: int, theta: float, s: dict, positions: torch.Tensor
) -> torch.Tensor:  # [P, D/2]
    """NTK: for a sequence of length L > max_position_embeddings the base becomes
    theta * (factor * L / max_len - (factor - 1)) ** (dim / (dim - 2)); L = position + 1."""
    factor, max_len = s["factor"], s["max_position_embeddings"]
    length = torch.clamp(positions + 1, min=max_len)  # [P]
    base = theta * ((factor * length / max_len) - (factor - 1)) ** (dim / (dim - 2))
    exponents = _arange(0, dim, 2).float() / dim  # [D/2]
    return 1.0 / (base[:, None] ** exponents[None, :])


def longrope_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:  # [D/2]
    """The default frequencies divided by per-dimension factors (short or long)."""
    exponents = _arange(0, dim, 2).float() / dim
    return 1.0 / (_floats(factors) * theta**exponents)


def long_rope(config: Any) -> tuple[int, int] | None:
    """For a longrope model, (k, rows): a sequence of more than k tokens
    (original_max_position_embeddings) is rotated with the long factors throughout, from the
    table's row `rows + position` (its long rows follow `rows` short ones); else None."""
    if not hasattr(config, "max_position_embeddings"):
        return None
    _, scaling = rope_parameters(config)
    if rope_type(scaling) != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"]), max_positions(config)


def _arange(start: int, end: int, step: int) -> torch.Tensor:
    return torch.arange(start, end, step, dtype=torch.int64, device="cpu")


def _floats(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device="cpu")
