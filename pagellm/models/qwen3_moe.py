"""Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm) with a sparse MoE block in every
`decoder_sparse_step`-th layer outside `mlp_only_layers` (the others keep a dense MLP of
`intermediate_size`). The router takes a softmax over all experts, then the top k,
renormalized when `norm_topk_prob`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.attention.base import AttentionBackend
from pagellm.layers.activation import require_silu
from pagellm.layers.moe import (
    SparseMoeBlock,
    is_sparse_layer,
    num_experts_of,
    use_sparse_mlps,
)
from pagellm.layers.moe_weights import MoEWeights
from pagellm.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Qwen3MoeForCausalLM(MoEWeights, Qwen3ForCausalLM):
    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        use_sparse_mlps(self, lambda i: qwen_moe_block(config, i))


def qwen_moe_block(config: PretrainedConfig, layer_idx: int) -> SparseMoeBlock | None:
    """Qwen2-MoE's and Qwen3-MoE's block for a layer (with Qwen2-MoE's shared expert when
    the config has one); None for a dense layer."""
    if not is_sparse_layer(config, layer_idx):
        return None
    require_silu(config, "Qwen-MoE")
    return SparseMoeBlock(
        config.hidden_size,
        num_experts_of(config),
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )
