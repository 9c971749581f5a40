"""Checkpoint tensors to model parameters, driven by a table of fused projections.

A model declares `packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}`: HF
name `...self_attn.k_proj.weight` goes to row range "k_proj" of `...self_attn.qkv_proj.weight`
(a `FusedLinear`). Every other name maps to the parameter of the same name, which is replaced
by the loaded tensor (no copy when dtype and device already match) if it is still on `meta`,
or copied into otherwise.

With tensor parallelism a module holds one rank's part of each checkpoint tensor; it says
which by `checkpoint_slice(param_name)` (a `TensorSlice`: rows or columns of the tensor), and
only that part is read (`CheckpointTensor`: from safetensors, only its bytes).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.kv_cache_dtype import checkpoint_kv_scale


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank holds: `size` entries along `dim` from `start`.
    Entries past the tensor's end are zeros (a vocabulary padded to a multiple of the ranks)."""

    dim: int
    start: int
    size: int


class CheckpointTensor:
    """One checkpoint tensor, read when asked, whole or one `TensorSlice`, and cast to the
    model's device and dtype as it is read.

    `source` is a torch tensor, or a safetensors slice (`safe_open(...).get_slice(name)`),
    from which a `TensorSlice` reads only its own bytes. A slice of a torch tensor is copied,
    so the parameter does not keep the whole tensor alive.
    """

    def __init__(
        self, source: Any, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        self.source = source.source if isinstance(source, CheckpointTensor) else source
        self.device = device
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self.source, torch.Tensor):
            return tuple(self.source.shape)
        return tuple(self.source.get_shape())

    def read(self, part: TensorSlice | None = None) -> torch.Tensor:
        if part is None:
            whole = self.source if isinstance(self.source, torch.Tensor) else self.source[()]
            return self._cast(whole, copy=False)
        extent = self.shape[part.dim]
        start, stop = min(part.start, extent), min(part.start + part.size, extent)
        index = (slice(None),) * part.dim + (slice(start, stop),)
        tensor = self._cast(self.source[index], copy=isinstance(self.source, torch.Tensor))
        if stop - start == part.size:
            return tensor
        pad = list(tensor.shape)
        pad[part.dim] = part.size - (stop - start)
        return torch.cat([tensor, tensor.new_zeros(pad)], dim=part.dim)

    def _cast(self, tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        device = self.device or tensor.device
        return tensor.to(device=device, dtype=self.dtype or tensor.dtype, copy=copy)


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    packed_modules: dict[str, tuple[str, ...]],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load (hf_name, tensor) pairs (torch tensors or `CheckpointTensor`s); return the
    parameter names that are fully loaded."""
    modules = dict(model.named_modules())
    fused_of = {part: fused for fused, parts in packed_modules.items() for part in parts}
    shards_seen: dict[str, set[str]] = defaultdict(set)
    loaded = set()
    for hf_name, tensor in weights:
        if skip(hf_name):
            continue
        if (kv_scale := checkpoint_kv_scale(hf_name)) is not None:  # fp8 KV cache scales
            owner, which = kv_scale
            attn = _module(modules, f"{owner}.attn", hf_name)
            attn.load_kv_scale(which, CheckpointTensor(tensor).read())
            continue
        module_name, _, param_name = hf_name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in fused_of:
            fused = f"{parent}.{fused_of[leaf]}" if parent else fused_of[leaf]
            load_param(_module(modules, fused, hf_name), param_name, tensor, shard=leaf)
            shards_seen[f"{fused}.{param_name}"].add(leaf)
        else:
            load_param(_module(modules, module_name, hf_name), param_name, tensor)
            loaded.add(hf_name)
    for name, seen in shards_seen.items():
        fused = name.rpartition(".")[0].rpartition(".")[2]
        if len(seen) == len(packed_modules[fused]):
            loaded.add(name)
    return loaded


def load_param(module: nn.Module, name: str, tensor: Any, shard: str | None = None) -> None:
    """Load this rank's part of a checkpoint tensor into parameter `name` of `module` (into
    row range `shard` of a fused one)."""
    if not isinstance(tensor, CheckpointTensor):
        tensor = CheckpointTensor(tensor)
    if shard is not None:
        module.load_shard(name, shard, tensor)
        return
    if hasattr(module, "load_full"):  # several parts in one tensor (a layer's stacked experts)
        module.load_full(name, tensor.read())
        return
    slicer = getattr(module, "checkpoint_slice", None)
    quantized = getattr(module, "quant_method", None) is not None  # its tensors, its shapes
    if slicer is not None and not quantized and tensor.shape != module.full_shape(name):
        raise ValueError(f"{name}: expected shape {module.full_shape(name)}, got {tensor.shape}")
    set_param(module, name, tensor.read(slicer(name) if slicer else None))


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


def check_loaded(model: nn.Module, loaded: set[str], checkpoint: str = "checkpoint") -> None:
    """Raise if a parameter (or a shard of a fused one) got no weights."""
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        fused = getattr(model, "packed_modules", {})
        shown = ", ".join(_checkpoint_names(n, fused) for n in missing[:5])
        shown += " ..." if len(missing) > 5 else ""
        raise ValueError(f"{checkpoint} has no weights for {len(missing)} parameter(s): {shown}")


def _checkpoint_names(name: str, fused: dict[str, tuple[str, ...]]) -> str:
    """A parameter's name as the checkpoint spells it: a fused layer's by its parts
    ("...mlp.gate_up_proj.qzeros" -> "...mlp.gate_proj.qzeros / up_proj.qzeros (fused)")."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf not in fused:
        return name
    prefix = f"{parent}." if parent else ""
    parts = " / ".join(f"{part}.{param}" for part in fused[leaf])
    return f"{prefix}{parts} (fused as {leaf}: one or more missing)"


def _module(modules: dict[str, nn.Module], name: str, hf_name: str) -> nn.Module:
    module = modules.get(name)
    if module is None:
        raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: the model has no {name!r}")
    return module
