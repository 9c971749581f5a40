"""A PEFT LoRA adapter folder read and checked against the base model.

A folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`) and
`adapter_model.safetensors` (or `adapter_model.bin`) with, per target module,
`...layers.N.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. PEFT
adds `lora_B(lora_A(x)) * scaling` to the module's output, `scaling` = alpha / r (rsLoRA:
alpha / sqrt(r)). `rank_pattern` / `alpha_pattern` give some modules their own r and alpha
(PEFT's `get_pattern_key`: the first key whose regex ends the module's name); the adapter's
rank is then the largest, and a module whose scale is not the adapter's has the ratio folded
into its B at load (one scale a slot). Everything the base model cannot take (another module,
a shape, a rank over `max_lora_rank`, a bias, DoRA, an init or layer replication that changes
the base model when PEFT loads the adapter) is a `ValueError` naming it, raised before the
request is queued.
A config without `lora_alpha` takes PEFT's default (8).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.lora.layers import lora_targets
from pagellm.utils import read_weights

logger = logging.getLogger(__name__)

# `...layers.N.<module path>.lora_A.weight`: the module's path inside decoder layer N
_KEY = re.compile(r"layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.default)?\.weight$")
# per decoder layer: PEFT module path -> (fan_in, fan_out) with one rank (`lora_targets`)
Shapes = list[dict[str, tuple[int, int]]]


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, module) -> (A [r, in], B [out, r]), float32, host."""

    rank: int  # the largest of its modules' ranks
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(decoder_layers, fused_names: bool = False) -> Shapes:
    """Each decoder layer's adapter targets and their one-rank shapes (`lora_targets`), by
    the names HF's model of the family has: a fused layer's parts (HF's Llama:
    `self_attn.q_proj`), or with `fused_names` the fused layer's own (HF's Phi-3:
    `self_attn.qkv_proj`). PEFT on HF's model ignores tensors of a module it lacks."""
    shapes = []
    for layer in decoder_layers:
        kept = {}
        for name, t in lora_targets(layer).items():
            fused = getattr(layer.get_submodule(t.linear), "full_rows", None) is not None
            if not fused or (t.part is None) == fused_names:
                kept[name] = (t.fan_in, t.fan_out)
        shapes.append(kept)
    return shapes


def base_model_shapes(architecture: str, hf_config: Any) -> Shapes:
    """`target_shapes` of the base model built on `meta` (no memory, no weights): what the
    caller checks an adapter against before the request is queued."""
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.models.registry import get_model_cls

    with torch.device("meta"):
        model = get_model_cls(architecture)(hf_config, TorchAttentionBackend)
    return target_shapes(model.model.layers, getattr(model, "lora_fused_names", False))


# PEFT's LoraConfig default, where adapter_config.json leaves lora_alpha out
PEFT_DEFAULT_LORA_ALPHA = 8
# init_lora_weights that PEFT applies to the base weights again at load (W - scale * B0 A0)
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# PEFT LoRA variants (LoraConfig fields) whose forward is not lora_B(lora_A(x)) * scaling on
# every token: served as plain LoRA, the adapter would give another model's ids
_VARIANTS = {
    "alora_invocation_tokens": "activated LoRA: PEFT applies the adapter only from the "
    "invocation tokens on",
    "use_bdlora": "block-diagonal LoRA, its A or B saved as blocks",
    "arrow_config": "Arrow: per-token routing among adapters",
    "kasa_config": "KaSA: a diagonal between A and B, and the base weights truncated",
    "monteclora_config": "MonteCLoRA: a sampled mixture of A",
}


def read_adapter_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json there")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    if "r" not in config:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json has no rank 'r'")
    if type(config["r"]) is not int:  # PEFT builds its Linear(in, r): an int, never a bool
        raise ValueError(f"LoRA adapter {path!r}: r={config['r']!r} is not an integer rank")
    alpha = config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha={alpha!r} is not a number")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA (use_dora) is not supported")
    if config.get("lora_bias"):
        raise ValueError(f"LoRA adapter {path!r}: lora_bias (a bias on lora_B) is not supported")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        # PEFT subtracts these inits' A0 B0 from the base weights when it loads the adapter:
        # the adapter alone, added to the unchanged base model, is another model
        raise ValueError(
            f"LoRA adapter {path!r}: init_lora_weights={config['init_lora_weights']!r} changes "
            "the base model's weights when PEFT loads it; convert it to a plain LoRA adapter "
            "(PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    if config.get("layer_replication"):
        raise ValueError(
            f"LoRA adapter {path!r}: layer_replication (PEFT re-stacks the base model's "
            "layers) is not supported"
        )
    for key, what in _VARIANTS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} ({what}) is not supported")
    return config


def adapter_scaling(config: dict[str, Any], r: Any = None, alpha: Any = None) -> float:
    """PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (`r` / `alpha`: a
    module's own, from the patterns)."""
    r = int(config["r"] if r is None else r)
    alpha = float(config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA) if alpha is None else alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def _patterns(path: str, config: dict[str, Any]) -> tuple[dict, dict]:
    """`rank_pattern` and `alpha_pattern`, checked: regex keys, int ranks, number alphas."""
    found = []
    for field, ok in (("rank_pattern", lambda v: type(v) is int),
                      ("alpha_pattern", lambda v: type(v) in (int, float))):  # fmt: skip
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise ValueError(f"LoRA adapter {path!r}: {field} is not a JSON object")
        for key, value in pattern.items():
            if not ok(value):
                raise ValueError(f"LoRA adapter {path!r}: {field}[{key!r}]={value!r} is not a "
                                 "number of the right kind")  # fmt: skip
            try:
                re.compile(key)
            except re.error as e:
                raise ValueError(f"LoRA adapter {path!r}: {field} key {key!r}: {e}") from None
        found.append(pattern)
    return found[0], found[1]


def _pattern_value(pattern: dict, name: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first key whose regex ends `name` at a dot."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def load_adapter(path: str, shapes: Shapes, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path`, checked against the base model's targets (see the module doc)."""
    config = read_adapter_config(path)
    rank_pattern, alpha_pattern = _patterns(path, config)
    names: dict[tuple[int, str], str] = {}  # (layer, module) -> its full name in HF's model
    pairs = _pair_tensors(path, _read_tensors(path), len(shapes), config, names)
    ranks = {key: _pattern_value(rank_pattern, names[key], config["r"]) for key in pairs}
    for rank in sorted(set(ranks.values())):  # `r` itself only where no pattern replaces it
        if rank < 1:
            raise ValueError(f"LoRA adapter {path!r}: rank {rank} is not a rank (r must be >= 1)")
        if rank > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {path!r}: rank {rank} is over max_lora_rank={max_lora_rank}"
            )
    for (layer, module), (a, b) in pairs.items():
        if module not in shapes[layer]:
            raise ValueError(
                f"LoRA adapter {path!r}: the base model has no {module} in layers.{layer} "
                f"(adapters may target {', '.join(sorted(shapes[layer]))})"
            )
        fan_in, fan_out = shapes[layer][module]
        rank = ranks[layer, module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(
                f"LoRA adapter {path!r}: layers.{layer}.{module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; the base model's {module} needs A ({rank}, {fan_in}) and "
                f"B ({fan_out}, {rank})"
            )
    # the slot's scale: the config's (1.0 if it is 0: lora_alpha 0, or r 0 with every module's
    # rank in rank_pattern); each module's own, where it differs, folded into its B
    scaling = (adapter_scaling(config) if config["r"] >= 1 else 0.0) or 1.0
    for key, (a, b) in pairs.items():
        alpha = _pattern_value(alpha_pattern, names[key], None)
        own = adapter_scaling(config, ranks[key], alpha)
        if own != scaling:
            pairs[key] = (a, b * (own / scaling))
    return LoRAAdapter(max(ranks.values()), scaling, pairs)


def _targeted(config: dict[str, Any], name: str, layer: int) -> bool:
    """Whether PEFT, building the adapter from its config, puts a LoRA layer on module `name`
    (its name in the base model) of decoder layer `layer` (PEFT loads the weights of those
    only: a config narrower than its file leaves the rest unread). `target_modules`: a list
    names modules exactly or by their last names, a string is a regex over the whole name
    ("all-linear": every projection); `exclude_modules` likewise; `layers_to_transform`:
    the layer indices kept."""

    def names(entries) -> bool:
        if isinstance(entries, str):
            return entries == "all-linear" or re.fullmatch(entries, name) is not None
        return any(name == e or name.endswith("." + e) for e in entries)

    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    if targets is not None and not names(targets):
        return False
    if excluded and names(excluded):
        return False
    layers = config.get("layers_to_transform")
    if layers is not None:
        return layer in ([layers] if isinstance(layers, int) else layers)
    return True


def _unsupported_kind(key: str, config: dict[str, Any]) -> str:
    """What an unsupported tensor is part of, for the error (else "")."""
    saved = config.get("modules_to_save") or ()
    if ".modules_to_save." in key or any(f".{m}." in key for m in saved):
        return f"modules_to_save ({', '.join(saved) or 'a trained copy of a module'}): "
    for module, what in (("lm_head", "the LM head"), ("embed_tokens", "the embeddings")):
        if f".{module}." in key:
            return f"LoRA on {what}: "
    return ""


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    tensors = read_weights(path, "adapter_model", f"LoRA adapter {path!r}")
    if tensors is None:
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or .bin) there")
    return tensors


def _pair_tensors(
    path: str,
    tensors: dict[str, torch.Tensor],
    num_layers: int,
    config: dict[str, Any],
    names: dict[tuple[int, str], str],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) in float32 of the modules the config targets (`_targeted`);
    an unknown module or layer is an error. `names` gets each pair's full module name."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    untargeted: set[str] = set()
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or "vision" in key:
            what = _unsupported_kind(key, config)
            raise ValueError(
                f"LoRA adapter {path!r}: {what}{key!r} is not supported (targets: the "
                "attention and MLP projections of the decoder layers)"
            )
        layer = int(match[1])
        name = key[: match.start(3) - len(".lora_")].removeprefix("base_model.model.")
        if not _targeted(config, name, layer):
            untargeted.add(name)
            continue
        if layer >= num_layers:
            raise ValueError(
                f"LoRA adapter {path!r}: {key!r} is for layer {layer}; the base model has "
                f"{num_layers} layers"
            )
        halves.setdefault((layer, match[2]), {})[match[3]] = tensor.float()
        names[layer, match[2]] = name
    pairs = {}
    for (layer, module), half in halves.items():
        if set(half) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layers.{layer}.{module} lacks lora_A or B")
        pairs[layer, module] = (half["A"], half["B"])
    if untargeted:
        names = sorted(untargeted)
        logger.warning("LoRA adapter %r: the weights of %d modules its config does not target "
                       "are left unread, as PEFT leaves them (%s%s)", path, len(names),
                       ", ".join(names[:3]), ", ..." if len(names) > 3 else "")  # fmt: skip
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: no LoRA weights in it of the modules its "
                         "config targets (target_modules, exclude_modules, "
                         "layers_to_transform)")  # fmt: skip
    return pairs
