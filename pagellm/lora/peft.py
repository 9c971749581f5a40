"""A PEFT LoRA adapter folder read and checked against the base model.

A folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`) and
`adapter_model.safetensors` (or `adapter_model.bin`) with, per target module,
`...layers.N.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. PEFT
adds `lora_B(lora_A(x)) * scaling` to the module's output, `scaling` = alpha / r (rsLoRA:
alpha / sqrt(r)). Everything the base model cannot take (another module, a shape, a rank
over `max_lora_rank`, a bias) is a `ValueError` naming it, raised before the request is queued.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# PEFT's module names -> the sublayer that holds them in a Llama-style decoder layer
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, module) -> (A [r, in], B [out, r]), float32, host."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module in a decoder layer of this config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
        return shapes  # an MoE block's experts take no adapters (yet)
    inter = hf_config.intermediate_size
    shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


def read_adapter_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json there")
    with open(config_file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported")
    return config


def adapter_scaling(config: dict[str, Any]) -> float:
    """PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def load_adapter(path: str, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path`, checked against the base model's config (see the module doc)."""
    config = read_adapter_config(path)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {path!r}: rank_pattern / alpha_pattern are not supported")
    rank = int(config["r"])
    if not 1 <= rank <= max_lora_rank:
        raise ValueError(
            f"LoRA adapter {path!r}: rank {rank} is over max_lora_rank={max_lora_rank}"
        )
    pairs = _pair_tensors(path, _read_tensors(path), hf_config.num_hidden_layers)
    shapes = module_shapes(hf_config)
    for (layer, module), (a, b) in pairs.items():
        if module not in shapes:
            raise ValueError(f"LoRA adapter {path!r}: the base model has no dense {module}")
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(
                f"LoRA adapter {path!r}: layers.{layer}.{module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; the base model's {module} needs A ({rank}, {fan_in}) and "
                f"B ({fan_out}, {rank})"
            )
    return LoRAAdapter(rank, adapter_scaling(config), pairs)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or .bin) there")


def _pair_tensors(
    path: str, tensors: dict[str, torch.Tensor], num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) in float32; an unknown module or layer is an error."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or TARGET_MODULES.get(match[3]) != match[2]:
            raise ValueError(
                f"LoRA adapter {path!r}: module {key!r} is not supported (targets: "
                f"{', '.join(TARGET_MODULES)} of the decoder layers)"
            )
        layer = int(match[1])
        if layer >= num_layers:
            raise ValueError(
                f"LoRA adapter {path!r}: {key!r} is for layer {layer}; the base model has "
                f"{num_layers} layers"
            )
        halves.setdefault((layer, match[3]), {})[match[4]] = tensor.float()
    pairs = {}
    for (layer, module), half in halves.items():
        if set(half) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layers.{layer}.{module} lacks lora_A or B")
        pairs[layer, module] = (half["A"], half["B"])
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: no LoRA weights in it")
    return pairs
