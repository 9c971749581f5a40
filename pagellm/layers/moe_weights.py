"""Per-expert checkpoint tensors stacked into a MoE layer's parameters at load (`MoEWeights`,
the mixin of Mixtral / Qwen2-MoE / Qwen3-MoE).

`<...>.experts.<e>.<projection>.<leaf>` goes into row block `shard` of expert e of the
stacked parameter the layer names for it (`FusedMoE.checkpoint_param`): a float `weight`
into w13 / w2; an int4 / int8 checkpoint's `qweight`, `scales`, ... (or fp8 values and scales
kept as stored) into its quantization method's stacked tensors. An fp8 expert weight the
layer does not keep (the CPU; `quantization="none"`) waits for its scale (or the scale for
it) and loads dequantized into w13 / w2.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

from pagellm.layers.moe import FusedMoE
from pagellm.layers.weights import CheckpointTensor

logger = logging.getLogger(__name__)

# `<...>.experts.<expert>.<projection>.<leaf>`: weight (fp8: with weight_scale[_inv]), qweight ...
_EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>\w+)"
)
FP8_KINDS = ("weight", "weight_scale", "weight_scale_inv")


class MoEWeights:
    """Mixin for a Llama-style model with `SparseMoeBlock`s: per-expert checkpoint tensors go
    into the stacked parameters; the rest loads as the model's `load_weights` loads it."""

    # stacked parameter -> the per-expert checkpoint projections stacked in it, in row order
    expert_params: dict[str, tuple[str, ...]] = {
        "w13": ("gate_proj", "up_proj"),
        "w2": ("down_proj",),
    }
    # checkpoint name fragment -> ours (transformers 5 keeps a layer's experts fused in memory)
    checkpoint_renames: dict[str, str] = {
        ".experts.gate_up_proj": ".experts.w13",
        ".experts.down_proj": ".experts.w2",
    }
    # other names a checkpoint gives a per-expert projection -> the one in expert_params
    expert_aliases: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        shards: dict[str, set[tuple[int, int]]] = defaultdict(set)
        fp8_parts: dict[str, dict[str, CheckpointTensor]] = defaultdict(dict)
        dequantized: list[str] = []
        loaded = super().load_weights(self._load_experts(weights, shards, fp8_parts, dequantized))
        if fp8_parts:  # a weight without its scale, or a scale without its weight
            stem, parts = next(iter(fp8_parts.items()))
            raise ValueError(f"fp8 expert weight {stem!r}: the checkpoint has only {sorted(parts)}")
        if dequantized:
            logger.info("fp8 checkpoint: %d MoE expert projections dequantized to the model "
                        "dtype at load (no fp8 expert GEMMs)", len(dequantized))  # fmt: skip
        for name, seen in shards.items():
            stacked = self.get_parameter(name)
            projections = self.expert_params[name.rpartition(".")[2].partition("_")[0]]
            if len(seen) == stacked.shape[0] * len(projections):
                loaded.add(name)
        return loaded

    def _load_experts(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        shards: dict[str, set],
        fp8_parts: dict[str, dict[str, CheckpointTensor]],
        dequantized: list[str],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load per-expert tensors (recording (expert, shard) pairs); yield every other one."""
        modules = dict(self.named_modules())
        param_of = {  # checkpoint projection -> (stacked parameter, shard, shards)
            proj: (param, i, len(projs))
            for param, projs in self.expert_params.items()
            for i, proj in enumerate(projs)
        }
        for hf_name, tensor in weights:
            name = hf_name
            for old, new in self.checkpoint_renames.items():
                name = name.replace(old, new)
            match = _EXPERT_TENSOR.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            experts = modules.get(match["experts"])
            proj = self.expert_aliases.get(match["proj"], match["proj"])
            if not isinstance(experts, FusedMoE) or proj not in param_of:
                raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: no such expert weight")
            stacked, shard, num_shards = param_of[proj]
            target = _target(experts, stacked, match["kind"], tensor, hf_name)
            if target is None:  # an fp8 part: loaded dequantized once weight and scale are in
                tensor = _fp8_pair(fp8_parts, name.rpartition(".")[0], match["kind"], tensor)
                if tensor is None:
                    continue
                dequantized.append(name.rpartition(".")[0])
                target = stacked
            try:
                experts.load_expert(target, int(match["expert"]), shard, num_shards, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {hf_name!r}: {exc}") from None
            shards[f"{match['experts']}.{target}"].add((int(match["expert"]), shard))


def _target(experts: FusedMoE, stacked: str, kind: str, tensor, hf_name: str) -> str | None:
    """The parameter a checkpoint tensor loads into; None for an fp8 part the layer does not
    keep (dequantized at load); ValueError for a tensor it has no place for."""
    target = experts.checkpoint_param(stacked, kind)
    if target is not None and not (experts.quant_method is None and _is_fp8(tensor)):
        return target
    if experts.quant_method is None and kind in FP8_KINDS:
        return None
    method = type(experts.quant_method).__name__ if experts.quant_method else "float"
    raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: the layer's experts "
                     f"({method}) have no place for a {kind!r}")  # fmt: skip


def _fp8_pair(fp8_parts: dict, stem: str, kind: str, tensor) -> torch.Tensor | None:
    """The dequantized weight once both its fp8 values and its scale are in, else None."""
    fp8_parts[stem][kind] = tensor
    if len(fp8_parts[stem]) < 2:
        return None
    try:
        return _dequantized(fp8_parts.pop(stem))
    except ValueError as exc:
        raise ValueError(f"fp8 expert weight {stem!r}: {exc}") from None


def _is_fp8(tensor: CheckpointTensor | torch.Tensor) -> bool:
    source = tensor.source if isinstance(tensor, CheckpointTensor) else tensor
    if isinstance(source, torch.Tensor):
        return source.dtype == torch.float8_e4m3fn
    get_dtype = getattr(source, "get_dtype", None)  # a safetensors slice
    return get_dtype is not None and get_dtype() == "F8_E4M3"


def _dequantized(parts: dict[str, CheckpointTensor | torch.Tensor]) -> torch.Tensor:
    """float32 weight from an fp8 expert projection's `weight` and its `weight_scale` (per
    tensor or per row) or `weight_scale_inv` (128 x 128 blocks)."""
    from pagellm.quantization.fp8 import dequantize_fp8

    read = {k: v.read() if isinstance(v, CheckpointTensor) else v for k, v in parts.items()}
    if "weight" not in read:
        raise ValueError(f"two scales and no weight: {sorted(read)}")
    ((kind, scale),) = ((k, v) for k, v in read.items() if k != "weight")
    weight = read["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a {kind} for a {weight.dtype} expert weight: an fp8 one was expected")
    return dequantize_fp8(weight, scale if scale.dim() == 2 else scale.reshape(-1))
