"""Gemma (1, `GemmaForCausalLM`; CodeGemma): Gemma 2's parts in Llama's layer layout.

Token embeddings times sqrt(hidden_size), (1 + w) RMSNorms and a GeGLU MLP as in Gemma 2
(`pagellm/models/gemma2.py`), but two norms a layer (before attention and before the MLP),
q.k scaled by head_dim ** -0.5, no soft-caps and no sliding windows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.layers.mlp import GatedMLP
from pagellm.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm
from pagellm.models.llama import AttentionOptions, LlamaDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class GemmaDecoderLayer1(LlamaDecoderLayer):
    """Llama's layer with Gemma's norms and GeGLU MLP."""

    def make_mlp(self, config: PretrainedConfig) -> nn.Module:
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        return GatedMLP(config.hidden_size, config.intermediate_size, act=act)

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(Gemma2ForCausalLM):
    gemma_layer_cls = GemmaDecoderLayer1

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type) -> None:
        super().__init__(config, attn_backend_cls)
        # HF's Gemma 1 soft-caps nothing, whatever its config says (a config may carry
        # Gemma 2's final_logit_softcapping: transformers keeps unknown keys)
        self.final_soft_cap = None

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        return [None] * config.num_hidden_layers
