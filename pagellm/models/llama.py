"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral) and the shared decoder used by Qwen2/3.

Module names follow HF (`model.layers.N.self_attn.o_proj`, ...) so checkpoint names map 1:1,
except the fused `qkv_proj` and `gate_up_proj` (see `packed_modules`). Variants differ only in
`AttentionOptions`: Qwen2 adds a q/k/v bias, Qwen3 a per-head RMSNorm on q and k.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.models.layers import (
    Attention,
    GatedMLP,
    Linear,
    PackedWeight,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    gather_logits,
    qk_norm_rotary,
)
from pagellm.models.weights import load_packed_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_of(config: PretrainedConfig) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    theta = (params or {}).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), params


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = hd = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, num_heads, num_kv_heads, hd, bias=options.qkv_bias
        )
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * hd, config.hidden_size, bias=options.o_bias)
        if options.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qk_norm = options.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, attn_backend_cls)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)  # [T, H+2H_kv, D]
        num_qk = self.num_heads + self.num_kv_heads
        if self.qk_norm:
            heads = (self.num_heads, self.num_kv_heads)
            q, k = qk_norm_rotary(qkv, self.q_norm, self.k_norm, cos_sin, *heads)
            v = qkv[:, num_qk:]
        else:  # rotate q and k in one go
            qk = apply_rotary(qkv[:, :num_qk], cos_sin)
            q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, num_qk:]
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend_cls, options)
        mlp_bias = getattr(config, "mlp_bias", False)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend_cls, options)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        theta, scaling = rope_of(config)
        max_pos = config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), max_pos, theta, scaling)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(cos_sin, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The model contract used by the runner: forward, compute_logits, load_weights."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        self.attn_backend_cls = attn_backend_cls
        self.model = LlamaModel(config, attn_backend_cls, self.attention_options(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.packed_tied_head: PackedWeight | None = None  # see prepack_cpu_weights
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer
        attn_metadata: Any,  # attn_backend_cls.build_metadata(common)
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] in the model's dtype (the sampler works in float32)
        return gather_logits(self._rank_logits(hidden), self.config.vocab_size)

    def _rank_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab / tp]: this rank's vocabulary rows
        if not self.tie_word_embeddings:
            return self.lm_head(hidden)
        if self.packed_tied_head is not None:
            return self.packed_tied_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        """Pack every Linear weight (x86 CPUs; see `pagellm.models.layers`); a tied
        LM head gets a packed copy, the embedding keeps its plain weight for lookups."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)
        if self.tie_word_embeddings:
            self.packed_tied_head = PackedWeight(self.model.embed_tokens.weight, batch_hint)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; return the names of the parameters fully loaded."""
        return load_packed_weights(self, weights, self.packed_modules, self._skip_weight)

    def _skip_weight(self, name: str) -> bool:
        if "rotary_emb." in name:  # old checkpoints store inv_freq
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture (sliding-window attention is not used)."""
