"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj), and a
sliding window on the layers HF marks (`use_sliding_window`, `max_window_layers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, qwen_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        return qwen_sliding_windows(config)
