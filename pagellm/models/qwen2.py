"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.models.llama import AttentionOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
