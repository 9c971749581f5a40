"""Gemma 2: the Llama decoder's parts, arranged and scaled Gemma's way.

- token embeddings times sqrt(hidden_size), the factor rounded to the model's dtype (as HF);
- RMSNorm times (1 + w), in float32 (`GemmaRMSNorm`: the checkpoint's w is stored as 1 + w
  in a float32 parameter when it loads, so the shared norm kernels multiply by it);
- a GeGLU MLP (gelu with its tanh approximation);
- four norms per layer: before and after attention, before and after the MLP;
- attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, scores
  soft-capped (`attn_logit_softcapping`), sliding-window layers (`layer_types`, every other
  one from the first) alternating with global ones;
- final logits soft-capped: cap * tanh(logits / cap) (`final_logit_softcapping`).

`GemmaModel` serves Gemma 3 too (`pagellm/models/gemma3.py`), which adds q/k norms and one
rotary table per layer type, and Gemma 1 (`pagellm/models/gemma.py`), with Llama's two norms
a layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers import fused_ops
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.rotary_embedding import RotaryEmbedding
from pagellm.layers.vocab_embedding import VocabParallelEmbedding
from pagellm.layers.weights import CheckpointTensor
from pagellm.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaForCausalLM,
    rotary_embedding,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

SLIDING = "sliding_attention"


class GemmaRMSNorm(RMSNorm):
    """y = (1 + w) * x / rms(x) in float32, cast back once (HF's Gemma order; Llama's rounds
    x / rms(x) first); `weight` holds 1 + w in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, quant_for: Any = None) -> torch.Tensor:
        # x: [..., size]; never quantized for the GEMM after it (its weight is float32)
        fused = self._fused(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, weight_first=True)[0]
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * self.weight).to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, quant_for: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self._fused(x)
        if residual is not None and fused is not None and x.dim() == 2:
            return fused.rms_norm(x, self.weight, self.eps, residual, weight_first=True)
        return super().forward_with_residual(x, residual)

    def _fused(self, x: torch.Tensor):
        """The Triton kernel reads the float32 weight whatever the activations' dtype (the CPU
        one wants the activations' dtype: torch ops there)."""
        fused = fused_ops.ops_for(x) if x.is_cuda else None
        ok = fused is not None and x.stride(-1) == 1 and x.dim() in (2, 3)
        return fused if ok else None


def unit_offset_norms(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """Checkpoint norm weights w -> 1 + w in float32, what `GemmaRMSNorm` multiplies by (a
    norm is whole on every tensor-parallel rank: read whole)."""
    for name, tensor in weights:
        if not name.endswith("norm.weight"):
            yield name, tensor
            continue
        whole = tensor.read() if isinstance(tensor, CheckpointTensor) else tensor
        yield name, whole.float() + 1.0


def layer_types(config: PretrainedConfig, pattern: int) -> list[str]:
    """`config.layer_types`, or (older configs) every `pattern`-th layer global, from the
    `pattern`-th on, the others sliding."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    n = config.num_hidden_layers
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend_cls, options, sliding_window)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=act)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.post_attention_layernorm(
            self.self_attn(cos_sin, hidden, kv_cache, attn_metadata)
        )
        hidden, residual = self.pre_feedforward_layernorm.forward_with_residual(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        windows: list[int | None],
        rope_keys: list[str],  # per layer: its table in `rotary`
        rotary: dict[str, RotaryEmbedding],
        layer_cls: type[nn.Module] | None = None,  # GemmaDecoderLayer; Gemma 1 has its own
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF multiplies by sqrt(hidden) cast to the weights' dtype (in bf16 59.866 -> 59.75)
        scale = torch.tensor(config.hidden_size**0.5, device="cpu")  # built on `meta` otherwise
        self.embed_scale = float(scale.to(torch.get_default_dtype()))
        layer_cls = layer_cls or GemmaDecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(config, attn_backend_cls, options, window) for window in windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_keys = rope_keys
        self.rotary = nn.ModuleDict(rotary)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        cos_sin = {key: table(positions, hidden.dtype) for key, table in self.rotary.items()}
        residual = None
        layers = zip(self.layers, self.rope_keys, kv_caches, strict=True)
        for layer, key, kv_cache in layers:
            hidden, residual = layer(cos_sin[key], hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 on `GemmaModel`; the model contract is Llama's (forward, compute_logits,
    load_weights), with soft-capped logits and (1 + w) norms."""

    sliding_window_pattern = 2  # older configs without layer_types: every other layer global
    gemma_layer_cls: type[nn.Module] | None = None  # None: GemmaDecoderLayer

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias,
            o_bias=bias,
            scale=config.query_pre_attn_scalar**-0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        types = layer_types(config, cls.sliding_window_pattern)
        return [window if kind == SLIDING else None for kind in types]

    @classmethod
    def rotary_tables(cls, config: PretrainedConfig) -> tuple[list[str], dict]:
        """(per layer, the key of its rotary table; the tables): one, shared, for Gemma 2."""
        return ["all"] * config.num_hidden_layers, {"all": rotary_embedding(config)}

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        options, windows = self.attention_options(config), self.sliding_windows(config)
        keys, tables = self.rotary_tables(config)
        return GemmaModel(
            config, attn_backend_cls, options, windows, keys, tables, self.gemma_layer_cls
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab], soft-capped in the model's dtype as HF does
        logits = super().compute_logits(hidden)
        if self.final_soft_cap is None:
            return logits
        return torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(unit_offset_norms(weights))
