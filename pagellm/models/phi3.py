"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with three checkpoint differences.

- q/k/v and gate/up are stored fused (`self_attn.qkv_proj`, `mlp.gate_up_proj`, gate rows
  first): they load whole into our fused layers, which stack them the same way;
- `longrope` (`su` in older configs) rope scaling with per-dimension short and long factors
  and an attention factor (`pagellm/layers/rope.py`), over `partial_rotary_factor` of each
  head (Phi-4-mini: 0.75);
- a `sliding_window` in the config windows every layer, as HF does (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class Phi3ForCausalLM(LlamaForCausalLM):
    # HF's Phi-3 has self_attn.qkv_proj and mlp.gate_up_proj, no q_proj / gate_proj: PEFT
    # adapters target those (`pagellm.lora.peft.target_shapes`)
    lora_fused_names = True

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        return (getattr(config, "sliding_window", None),) * config.num_hidden_layers
