"""IBM Granite (3.x, `GraniteForCausalLM`): the Llama decoder with four scalars of its config.

- `embedding_multiplier`: the token embeddings are multiplied by it;
- `attention_multiplier`: the q.k scale, in place of head_dim ** -0.5;
- `residual_multiplier`: each sublayer's output is multiplied by it before it joins the
  residual stream;
- `logits_scaling`: the logits are divided by it.

Its layers are not the C++ CPU decoder's (`LlamaDecoderLayer` only), so on the CPU they run
layer by layer in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, *args: Any) -> None:
        super().__init__(config, *args)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output, already scaled
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(
            hidden * self.residual_multiplier, residual
        )
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=config.attention_multiplier)

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        self.logits_scaling = float(config.logits_scaling)

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        model = super().build_model(config, attn_backend_cls)
        model.embed_scale = float(config.embedding_multiplier)
        return model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
