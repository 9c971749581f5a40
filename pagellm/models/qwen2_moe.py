"""Qwen2-MoE: Qwen2's decoder (q/k/v bias, `qkv_bias` in its config) with Qwen3-MoE's
sparse layers plus a shared expert in each, scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.attention.base import AttentionBackend
from pagellm.layers.moe import use_sparse_mlps
from pagellm.layers.moe_weights import MoEWeights
from pagellm.models.llama import AttentionOptions
from pagellm.models.qwen2 import Qwen2ForCausalLM
from pagellm.models.qwen3_moe import qwen_moe_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Qwen2MoeForCausalLM(MoEWeights, Qwen2ForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        use_sparse_mlps(self, lambda i: qwen_moe_block(config, i))
