"""Gemma 3 (text): Gemma 2's decoder (`pagellm/models/gemma2.py`) with

- a (1 + w) RMSNorm over head_dim on q and k before rotary (no attention soft-capping: HF's
  Gemma 3 ignores `attn_logit_softcapping`);
- two rotary tables: local (sliding) layers use their own base (10k), global layers the
  global one (1M) with its scaling (linear x8 on the 4B and larger);
- five sliding layers to one global (`layer_types`; `sliding_window_pattern` in older configs).

`Gemma3ForConditionalGeneration` checkpoints (the multimodal ones) load their language model
here: its tensors are renamed to the text model's, the vision tower's are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from pagellm.models.gemma2 import SLIDING, Gemma2ForCausalLM, GemmaRMSNorm, layer_types
from pagellm.models.llama import AttentionOptions, rotary_embedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


def rope_params_of(config: PretrainedConfig, layer_type: str) -> dict:
    """One layer type's rope parameters: `rope_parameters[type]` (transformers 5), or
    `rope_local_base_freq` (sliding) / `rope_theta` + `rope_scaling` (global) before."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type])
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": config.rope_theta}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    sliding_window_pattern = 6

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        scale = config.query_pre_attn_scalar**-0.5
        return AttentionOptions(bias, bias, qk_norm=True, norm_cls=GemmaRMSNorm, scale=scale)

    @classmethod
    def rotary_tables(cls, config: PretrainedConfig) -> tuple[list[str], dict]:
        keys = layer_types(config, cls.sliding_window_pattern)
        tables = {key: rotary_embedding(config, rope_params_of(config, key)) for key in set(keys)}
        return keys, tables


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (text in, text out)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_language_model_tensors(weights))


# checkpoint prefixes of the language model (transformers 4 and 5 layouts) -> the text model's
_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}


def _language_model_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for prefix, ours in _PREFIXES.items():
            if name.startswith(prefix):
                yield ours + name.removeprefix(prefix), tensor
                break  # vision tower and projector tensors match no prefix: skipped
