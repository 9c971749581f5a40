"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k (before rotary), no bias."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, qwen_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        return qwen_sliding_windows(config)
