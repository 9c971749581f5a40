"""DeepSeek V2 (V2-Lite, V2, V2.5) and V3 (V3, R1 and their shape): multi-head latent
attention (`pagellm/layers/mla.py`, its cache one latent row a token) and MoE with shared
experts and grouped top-k routing (`pagellm/layers/deepseek_moe.py`), dense MLPs in the first
`first_k_dense_replace` layers. V2 routes by softmax, V3 by sigmoid with its score-correction
bias; V2 rotates interleaved pairs, V3 too unless `rope_interleave` is False.

Checkpoint names are HF's; per-expert tensors are stacked at load (`MoEWeights`), a dense or
shared MLP's gate and up fused. The routers load in float32 (HF keeps them so), and a V3
checkpoint's multi-token-prediction layers (`model.layers.<num_hidden_layers>...`) are
skipped: only the main model is served.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers.activation import require_silu
from pagellm.layers.deepseek_moe import DeepseekMoE, is_moe_layer, mlp_bias
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.mla import LatentAttention
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe_weights import MoEWeights
from pagellm.layers.rope import max_positions, rope_parameters
from pagellm.layers.rotary_embedding import RotaryEmbedding
from pagellm.layers.vocab_embedding import VocabParallelEmbedding
from pagellm.layers.weights import CheckpointTensor
from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FLOAT32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, sigmoid: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = LatentAttention(config)
        if is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = DeepseekMoE(config, sigmoid)
        else:  # V2's `mlp_bias` (HF's dense MLP and shared experts take it; V3 has none)
            self.mlp = GatedMLP(h, config.intermediate_size, bias=mlp_bias(config))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, P]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]; None before the first layer
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: PretrainedConfig, sigmoid: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, sigmoid) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            config.qk_rope_head_dim, max_positions(config), theta, scaling
        )

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


class DeepseekV2ForCausalLM(MoEWeights, LlamaForCausalLM):
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}
    sigmoid_router = False  # V2: softmax

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        """The decoder; latent attention runs on its own (`pagellm/attention/mla.py`), reading
        the step's metadata of whichever backend the runner built it with."""
        require_silu(config, type(self).__name__)
        if not self.sigmoid_router and getattr(config, "topk_method", None) == "noaux_tc":
            # V3's router under V2's name: HF's V2 cannot run it either; never route it as V2's
            raise ValueError(f"{type(self).__name__}: topk_method 'noaux_tc' is V3's router "
                             "(sigmoid scores with a correction bias); its architecture is "
                             "DeepseekV3ForCausalLM")  # fmt: skip
        return DeepseekModel(config, self.sigmoid_router)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._main_model(weights))

    def _main_model(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The main model's tensors (MTP layers and empty shared experts dropped), the
        routers' in float32."""
        layers = self.config.num_hidden_layers
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match is not None and int(match[1]) >= layers:
                continue
            if ".shared_experts." in name and 0 in CheckpointTensor(tensor).shape:
                continue  # n_shared_experts 0: HF saves empty projections, we build none
            if name.endswith(_FLOAT32):
                device = tensor.device if isinstance(tensor, CheckpointTensor) else None
                tensor = CheckpointTensor(tensor, device, torch.float32)
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    sigmoid_router = True  # sigmoid scores, e_score_correction_bias, norm_topk_prob
