"""EAGLE-3 draft heads (`speculative_config={"method": "eagle3", "model": <head folder>}`) in
their published checkpoint layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: `midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t`, `t2d`; architecture `LlamaForCausalLMEagle3`).

A head is one decoder layer that reads, at each position p, the embedding of the token after p
and a feature of p: the target's residual stream entering three of its layers (`fc` folds the
three [3 H_target] -> [H]), or, for a draft past the target's tokens, the head's own output at
the position before. Its attention's q | k | v read both side by side [2 H], each normed apart
(`input_layernorm` the embedding, `hidden_norm` the feature, the feature also the residual);
its output (before `norm`) is the next position's feature, and `lm_head(norm(.))` scores a
draft vocabulary whose id d is the target's d + d2t[d]. The embeddings are the target's
(EAGLE trains with them frozen; a checkpoint's copy is not read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import Linear, QKVParallelLinear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.vocab_embedding import ParallelLMHead, gather_logits
from pagellm.layers.weights import CheckpointTensor, load_packed_weights
from pagellm.models.llama import AttentionOptions, LlamaAttention, rotary_embedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def aux_hidden_layers(config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming residual stream the head reads: its config's
    `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), else EAGLE-3's
    (2, n // 2, n - 3); three distinct layers of the target, or a ValueError."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    ids = ids or eagle.get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    ids = tuple(ids) if ids else (2, n // 2, n - 3)
    if len(set(ids)) != 3 or not all(0 <= i < n for i in ids):
        raise ValueError(
            f"an EAGLE-3 head reads 3 distinct layers of its target's {n}, got {list(ids)} "
            "(eagle_aux_hidden_state_layer_ids)"
        )
    return tuple(sorted(ids))


class Eagle3Attention(LlamaAttention):
    """Llama's attention, q | k | v read from [2 hidden]: the embedding and the feature."""

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls, AttentionOptions())
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(2 * hidden, heads, kv_heads, self.head_dim, bias=False)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config, attn_backend_cls)
        self.mlp = GatedMLP(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        embeds: torch.Tensor,  # [T, hidden]: the token after each position
        feature: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        hidden = feature + self.self_attn(cos_sin, x, kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3LlamaForCausalLM(nn.Module):
    """The head: `forward` (features in, features out), `compute_logits` (draft vocabulary),
    `to_target_ids`, `load_weights`; `use_target_embedding` before the first forward."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        return (None,)

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.fc = Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, attn_backend_cls)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = ParallelLMHead(hidden, self.draft_vocab_size)
        self.rotary_emb = rotary_embedding(config)
        # draft id d is the target's d + d2t[d] (zeros: the same vocabulary)
        d2t = torch.zeros(self.draft_vocab_size, dtype=torch.int64, device="cpu")
        self.register_buffer("d2t", d2t)
        self.target_embed: nn.Module | None = None

    def use_target_embedding(self, embed: nn.Module) -> None:
        """The target's token embedding (held, not owned: not a submodule of the head)."""
        object.__setattr__(self, "target_embed", embed)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the token after each position
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one
        attn_metadata: Any,
        feature: torch.Tensor | None = None,  # [T, 3 target hidden] or [T, hidden] (its own)
    ) -> torch.Tensor:  # [T, hidden]: each position's output, the next one's feature
        if feature is None or self.target_embed is None:
            raise ValueError(
                "an EAGLE-3 head drafts for a target model (speculative_config method "
                "'eagle3'); it is not served alone"
            )
        if feature.shape[-1] != self.config.hidden_size:
            feature = self.fc(feature)
        embeds = self.target_embed(input_ids).to(feature.dtype)
        cos_sin = self.rotary_emb(positions, feature.dtype)
        return self.midlayer(cos_sin, embeds, feature, kv_caches[0], attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, draft vocabulary]
        return gather_logits(self.lm_head(self.norm(hidden)), self.draft_vocab_size)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors; `d2t` into its buffer, `t2d` (the inverse map) and an
        embedding copy skipped."""
        return load_packed_weights(self, self._layer_weights(weights), self.packed_modules)

    def _layer_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name == "d2t":
                raw = CheckpointTensor(tensor).source  # int64, not the model's dtype
                raw = raw if isinstance(raw, torch.Tensor) else raw[()]
                want = tuple(self.d2t.shape)
                if tuple(raw.shape) != want:
                    raise ValueError(f"d2t: expected shape {want}, got {tuple(raw.shape)}")
                if not raw.is_meta:
                    self.d2t.copy_(raw.to(torch.int64))
            elif name != "t2d" and not name.startswith("embed_tokens."):
                yield name, tensor
