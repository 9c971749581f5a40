"""Mixtral: Mistral's decoder (its sliding window included) with a sparse MoE block in every
layer. Its router takes a softmax over the top-k logits; checkpoints name a layer's block
`block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.attention.base import AttentionBackend
from pagellm.layers.activation import require_silu
from pagellm.layers.moe import SparseMoeBlock, num_experts_of, use_sparse_mlps
from pagellm.layers.moe_weights import MoEWeights
from pagellm.models.llama import MistralForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class MixtralForCausalLM(MoEWeights, MistralForCausalLM):
    expert_params = {"w13": ("w1", "w3"), "w2": ("w2",)}
    checkpoint_renames = {".block_sparse_moe.": ".mlp.", **MoEWeights.checkpoint_renames}
    # llm-compressor and GPTQModel unfuse transformers 5's experts into Linears named as
    # Qwen's, and save them so (`<...>.experts.<e>.gate_proj.weight_packed` / `.qweight`)
    expert_aliases = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        use_sparse_mlps(self, lambda _: mixtral_block(config))


def mixtral_block(config: PretrainedConfig) -> SparseMoeBlock:
    require_silu(config, "Mixtral")
    return SparseMoeBlock(
        config.hidden_size,
        num_experts_of(config),
        config.num_experts_per_tok,
        config.intermediate_size,
        renormalize=True,
    )
