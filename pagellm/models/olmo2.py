"""OLMo 2: the Llama decoder with its norms moved.

- q and k are RMS-normed over the whole projection (all heads at once, weights of
  `num_heads * head_dim` and `num_kv_heads * head_dim`) before they are split into heads;
- no norm before attention or the MLP: each sublayer's output is normed, then added to the
  residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`).

The layer keeps the shared decoder's (hidden, residual) convention: the stream after a layer
is `hidden + residual`, so the final norm adds them as it does for Llama.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.models.layers import (
    Attention,
    FusedLinear,
    GatedMLP,
    Linear,
    RMSNorm,
    apply_rotary,
)
from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Olmo2Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = hd = head_dim_of(config)
        self.sizes = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]
        shards = dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes))
        self.qkv_proj = FusedLinear(config.hidden_size, shards, bias=options.qkv_bias)
        self.o_proj = Linear(self.num_heads * hd, config.hidden_size, bias=options.o_bias)
        self.q_norm = RMSNorm(self.sizes[0], config.rms_norm_eps)
        self.k_norm = RMSNorm(self.sizes[1], config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, attn_backend_cls)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)  # [T, H * D], [T, H_kv * D]
        heads = (hidden.shape[0], -1, self.head_dim)
        q = apply_rotary(self.q_norm(q).view(heads), cos_sin)  # [T, H, D]
        k = apply_rotary(self.k_norm(k).view(heads), cos_sin)  # [T, H_kv, D]
        return self.o_proj(self.attn(q, k, v.view(heads), kv_cache, attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, attn_backend_cls, options)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        attn = self.self_attn(cos_sin, stream, kv_cache, attn_metadata)
        stream = stream + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
