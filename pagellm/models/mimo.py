"""Xiaomi MiMo (`MiMoForCausalLM`): a Qwen2 decoder whose checkpoint also carries
multi-token-prediction layers (`model.mtp_layers.{i}.*`, `num_nextn_predict_layers` of them),
which speculative decoding drafts with (`speculative_config={"method": "mtp"}`,
`pagellm/spec_decode/mtp.py`); the target itself skips them.

An MTP layer reads, at each position p, the target's output there (after its final norm) and
the embedding of the token after p: `input_proj` folds `hidden_layernorm(feature)` and
`token_layernorm(embedding)`, side by side in that order, into [hidden]; a Qwen2 decoder
layer and `final_layernorm` follow. Its output is both what the target's LM head scores (the
draft for p + 2) and the feature of the next position's step, so one layer drafts any number
of tokens. The embedding and the LM head are the target's (shared in the checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import Linear
from pagellm.layers.weights import load_packed_weights
from pagellm.models.llama import LlamaDecoderLayer, rotary_embedding
from pagellm.models.qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MTP_PREFIX = "model.mtp_layers."


class MiMoForCausalLM(Qwen2ForCausalLM):
    """The target: Qwen2, its checkpoint's MTP layers left to the MTP head."""

    def _skip_weight(self, name: str) -> bool:
        return name.startswith(MTP_PREFIX) or super()._skip_weight(name)


class MiMoMTPLayer(LlamaDecoderLayer):
    """A Qwen2 decoder layer with MTP's input fold before it and its final norm after."""

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        options = Qwen2ForCausalLM.attention_options(config)
        super().__init__(config, attn_backend_cls, options, None)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(hidden, eps)
        self.hidden_layernorm = RMSNorm(hidden, eps)
        self.input_proj = Linear(2 * hidden, hidden, bias=False)
        self.final_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        embeds: torch.Tensor,  # [T, hidden]: the token after each position
        feature: torch.Tensor,  # [T, hidden]: the target's output there (or this layer's)
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        x = torch.cat([self.hidden_layernorm(feature), self.token_layernorm(embeds)], dim=-1)
        hidden, residual = super().forward(
            cos_sin, self.input_proj(x), None, kv_cache, attn_metadata
        )
        return self.final_layernorm(hidden + residual)


class MiMoMTPHead(nn.Module):
    """The head (architecture `MiMoMTPModel`: `pagellm/engine/draft_config.py` builds its
    config from the target's): its first MTP layer (each draft iterates it, as vLLM does); `forward`
    (features in, features out), `compute_logits` (the target's LM head), `load_weights`
    from the target's own checkpoint; `use_target_embedding` and `use_target_head` before
    the first forward."""

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
        self.mtp_layers = nn.ModuleList([MiMoMTPLayer(config, attn_backend_cls)])
        self.rotary_emb = rotary_embedding(config)
        self.target_embed: nn.Module | None = None
        self.target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_target_embedding(self, embed: nn.Module) -> None:
        """The target's token embedding (held, not owned: not a submodule of the head)."""
        object.__setattr__(self, "target_embed", embed)

    def use_target_head(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's `compute_logits`: the LM head the MTP layers share."""
        self.target_logits = compute_logits

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the token after each position
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one
        attn_metadata: Any,
        feature: torch.Tensor | None = None,  # [T, hidden]
    ) -> torch.Tensor:  # [T, hidden]: each position's output, the next one's feature
        if feature is None or self.target_embed is None:
            raise ValueError(
                "a MiMo MTP head drafts for its own checkpoint's model (speculative_config "
                "method 'mtp'); it is not served alone"
            )
        embeds = self.target_embed(input_ids).to(feature.dtype)
        # position 0 has no token before it to predict from: its embedding is zeroed (vLLM)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        cos_sin = self.rotary_emb(positions, feature.dtype)
        return self.mtp_layers[0](cos_sin, embeds, feature, kv_caches[0], attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab]
        return self.target_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's own vocabulary

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The first MTP layer's tensors of the whole checkpoint (`model.mtp_layers.0.*`);
        the rest is the target's."""
        return load_packed_weights(self, self._mtp_weights(weights), self.packed_modules)

    def _mtp_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        first = f"{MTP_PREFIX}0."
        for name, tensor in weights:
            if name.startswith(first) and "rotary_emb." not in name:
                yield "mtp_layers.0." + name.removeprefix(first), tensor
