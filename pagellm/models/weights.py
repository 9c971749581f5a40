"""Checkpoint tensors to model parameters, driven by a table of fused projections.

A model declares `packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}`: HF
name `...self_attn.k_proj.weight` goes to row range "k_proj" of `...self_attn.qkv_proj.weight`
(a `FusedLinear`). Every other name maps to the parameter of the same name, which is replaced
by the loaded tensor (no copy when dtype and device already match) if it is still on `meta`,
or copied into otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagellm.attention.kv_cache_dtype import checkpoint_kv_scale


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, ...]],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load (hf_name, tensor) pairs; return the parameter names that are fully loaded."""
    modules = dict(model.named_modules())
    fused_of = {part: fused for fused, parts in packed_modules.items() for part in parts}
    shards_seen: dict[str, set[str]] = defaultdict(set)
    loaded = set()
    for hf_name, tensor in weights:
        if skip(hf_name):
            continue
        if (kv_scale := checkpoint_kv_scale(hf_name)) is not None:  # fp8 KV cache scales
            owner, which = kv_scale
            _module(modules, f"{owner}.attn", hf_name).load_kv_scale(which, tensor)
            continue
        module_name, _, param_name = hf_name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in fused_of:
            fused = f"{parent}.{fused_of[leaf]}" if parent else fused_of[leaf]
            _module(modules, fused, hf_name).load_shard(param_name, leaf, tensor)
            shards_seen[f"{fused}.{param_name}"].add(leaf)
        else:
            set_param(_module(modules, module_name, hf_name), param_name, tensor)
            loaded.add(hf_name)
    for name, seen in shards_seen.items():
        fused = name.rpartition(".")[0].rpartition(".")[2]
        if len(seen) == len(packed_modules[fused]):
            loaded.add(name)
    return loaded


def set_param(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Assign `tensor` as parameter `name` of `module` (copy if it is already materialized)."""
    param = getattr(module, name, None)
    if not isinstance(param, nn.Parameter):
        raise ValueError(f"{type(module).__name__} has no parameter {name!r}")
    if tensor.shape != param.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    if param.is_meta:
        tensor = tensor.to(param.dtype)
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    else:
        param.data.copy_(tensor)


def materialize(module: nn.Module, name: str, device: torch.device) -> nn.Parameter:
    """Parameter `name` of `module`, first given uninitialized memory on `device` if it is
    still on `meta` (for loaders that fill it piece by piece)."""
    param = getattr(module, name)
    if param.is_meta:
        param = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False
        )
        setattr(module, name, param)
    return param


def check_loaded(model: nn.Module, loaded: set[str]) -> None:
    """Raise if a parameter (or a shard of a fused one) got no weights."""
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint has no weights for {len(missing)} parameter(s): {shown}")


def _module(modules: dict[str, nn.Module], name: str, hf_name: str) -> nn.Module:
    module = modules.get(name)
    if module is None:
        raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: the model has no {name!r}")
    return module
