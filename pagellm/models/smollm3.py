"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder with NoPE layers.

`no_rope_layers[i]` is 0 where layer i's q and k are not rotated (every fourth layer in
SmolLM3-3B, from `no_rope_layer_interval`); with `use_sliding_window`, the layers
`layer_types` marks "sliding_attention" see only their last `sliding_window` tokens. NoPE
layers are not the C++ CPU decoder's (it rotates every layer), so on the CPU such a model runs
layer by layer in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        window, n = getattr(config, "sliding_window", None), config.num_hidden_layers
        if not getattr(config, "use_sliding_window", False) or window is None:
            return (None,) * n
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return tuple(window if kind == "sliding_attention" else None for kind in types)

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        model = super().build_model(config, attn_backend_cls)
        for layer, use_rope in zip(model.layers, config.no_rope_layers, strict=True):
            layer.self_attn.rotary = bool(use_rope)
        return model
