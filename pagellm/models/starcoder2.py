"""StarCoder2 (`Starcoder2ForCausalLM`): the Llama decoder with GPT-style parts.

- LayerNorms with a bias (`norm_epsilon`) where Llama has RMSNorms, the final one too;
- a plain MLP, c_proj(gelu_tanh(c_fc(x))), not a gated one;
- a bias on every projection (`use_bias`);
- `sliding_window`, when the config sets one, on every layer.

Its layers are not the C++ CPU decoder's, so on the CPU they run layer by layer in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagellm.models.llama import (
    AttentionOptions,
    LlamaDecoderLayer,
    LlamaModel,
    MistralForCausalLM,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

# HF activation name -> F.gelu's approximation
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with the decoders' residual convention (`RMSNorm.forward_with_residual`)."""

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, quant_for: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        return self(stream), stream


class Starcoder2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        if act not in _GELU:
            raise ValueError(f"StarCoder2 activation {act!r} is not supported: {sorted(_GELU)}")
        self.approximate = _GELU[act]
        self.c_fc = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.c_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (`LlamaDecoderLayer`) with StarCoder2's MLP and LayerNorms."""

    def make_mlp(self, config: PretrainedConfig) -> nn.Module:
        return Starcoder2MLP(
            config.hidden_size, config.intermediate_size, config.use_bias, config.hidden_act
        )

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.norm_epsilon)


class Starcoder2ForCausalLM(MistralForCausalLM):
    """Mistral's windows (every layer, when the config sets one) over StarCoder2's layers."""

    decoder_layer_cls = Starcoder2DecoderLayer

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias)

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        options, windows = self.attention_options(config), self.sliding_windows(config)
        norm = LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        return LlamaModel(config, attn_backend_cls, options, windows, self.decoder_layer_cls, norm)
