"""Mixture-of-experts layers: the router's top-k (`select_experts`), the experts as stacked
weights (`FusedMoE`), the sparse MLP block of Mixtral / Qwen2-MoE / Qwen3-MoE
(`SparseMoeBlock`), and per-expert checkpoint tensors stacked at load (`MoEWeights`).

The experts of a layer are two parameters, the expert dimension first:

    w13: [E, 2I, H]  gate_proj rows, then up_proj rows (Mixtral: w1, then w3)
    w2:  [E, H, I]   down_proj (Mixtral: w2)

Tensor parallelism splits I over the ranks: rank r holds rows [r * I / tp, (r + 1) * I / tp)
of each expert's gate and up projections (w13) and those columns of its down projection
(w2), read as slices (`FusedMoE.load_expert`); one all-reduce sums the ranks' outputs, as
for a dense MLP. The router is replicated.

On CUDA the top-k and the experts run as Triton kernels (`pagellm/kernels/fused_moe.py`: no
host sync, safe in CUDA graphs). On the CPU they are torch (`experts_torch`): the (token, k)
rows sorted by expert, one gate_up and one down matmul per expert over its rows. That path
is the reference the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.parallel_state import all_reduce, divide, get_tp_group
from pagellm.layers.linear import Linear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.weights import CheckpointTensor, TensorSlice, materialize

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

logger = logging.getLogger(__name__)


@functools.cache
def _kernel_module():
    try:
        from pagellm.kernels import fused_moe
    except ImportError:  # no Triton
        return None
    return fused_moe


def _kernels(x: torch.Tensor):
    """The fused-MoE Triton module for a CUDA tensor; None on the CPU (the torch path)."""
    return _kernel_module() if x.is_cuda else None


def select_experts(
    logits: torch.Tensor,  # [T, E] router logits
    top_k: int,
    renormalize: bool,  # divide the top-k probabilities by their sum
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int32
    """HF's routing: softmax over all experts in float32, then the top k. With `renormalize`
    (Mixtral always; Qwen-MoE with norm_topk_prob) that is a softmax over the top-k logits."""
    kernels = _kernels(logits)
    if kernels is not None:
        return kernels.topk_softmax(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def experts_torch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] expert ids
) -> torch.Tensor:  # [T, H]
    """sum over k of weights[t, k] * expert ids[t, k] applied to x[t]: the N = T * K rows
    sorted by expert, one matmul pair per expert over its rows (a loop over experts, not
    tokens). Rounds where `fused_moe` rounds: each expert's output, then times the weight."""
    t, k = ids.shape
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)  # [N]: rows grouped by expert, in row order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the CPU path may sync
    rows = x[order // k]  # [N, H]
    y = torch.empty_like(rows)  # [N, H]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gate, up = F.linear(rows[start : start + count], w13[expert]).chunk(2, dim=-1)
            y[start : start + count] = F.linear(F.silu(gate) * up, w2[expert])
        start += count
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    out = torch.empty_like(y)
    out[order] = y  # back to row order: row r is token r // K, its k-th expert
    return out.view(t, k, -1).sum(dim=1)


class FusedMoE(nn.Module):
    """A layer's experts as stacked weights, and the routing of tokens to them."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, divide(intermediate_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        self.full_intermediate = intermediate_size
        self.reduce = get_tp_group().size > 1
        # this rank's part of each expert's I: rows of gate / up, columns of down
        self.part = TensorSlice(0, get_tp_group().rank * i, i)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        kernels = _kernels(x)
        if kernels is not None:
            out = kernels.fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = experts_torch(x, self.w13, self.w2, weights, ids)
        return all_reduce(out) if self.reduce else out

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """The shape with one rank (random weights are drawn at it, then cut)."""
        e, h, i = self.w13.shape[0], self.w13.shape[2], self.full_intermediate
        return (e, 2 * i, h) if param_name == "w13" else (e, h, i)

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        """Load every expert from a tensor of `full_shape`: this rank's part of each."""
        shards = tensor.chunk(2, dim=1) if param_name == "w13" else (tensor,)
        for expert in range(tensor.shape[0]):
            for shard, rows in enumerate(shards):
                self.load_expert(param_name, expert, shard, len(shards), rows[expert])

    def load_expert(
        self, param_name: str, expert: int, shard: int, num_shards: int, tensor: torch.Tensor
    ) -> None:
        """Write this rank's part of one expert's checkpoint projection into row block `shard`
        of `num_shards` of its stacked parameter (w13: gate 0, up 1 of 2; w2: down, 0 of 1)."""
        if not isinstance(tensor, CheckpointTensor):
            tensor = CheckpointTensor(tensor)
        part = self.part if param_name == "w13" else TensorSlice(1, self.part.start, self.part.size)
        tensor = tensor.read(part if self.reduce else None)
        param = materialize(self, param_name, tensor.device)
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"expert {expert} of {param_name}: the layer has {param.shape[0]}")
        rows = param.shape[1] // num_shards
        target = param.data[expert, shard * rows : (shard + 1) * rows]
        if tensor.shape != target.shape:
            raise ValueError(
                f"expert {expert} of {param_name}, shard {shard}: expected "
                f"{tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)


class SparseMoeBlock(nn.Module):
    """An MoE layer's MLP: router (`gate`), experts, and Qwen2-MoE's shared expert scaled by
    sigmoid(shared_expert_gate(x)) when `shared_intermediate_size` is set. Names follow HF."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        # routers stay in the model dtype under any quantization (fp8 checkpoints store them so)
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.gate.quantizable = False
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.quantizable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def num_experts_of(config: PretrainedConfig) -> int:
    """`num_experts` (Qwen) or `num_local_experts` (Mixtral; and Qwen3-MoE's config dict in
    transformers 5, which maps one name to the other)."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = getattr(config, "mlp_only_layers", None) or []
    sparse = num_experts_of(config) > 0 and (layer_idx + 1) % step == 0
    return sparse and layer_idx not in dense


def use_sparse_mlps(model: nn.Module, make_block: Callable[[int], nn.Module | None]) -> None:
    """Give each decoder layer the block `make_block(layer_idx)` returns in place of the
    dense MLP the Llama decoder built (on `meta`: nothing was allocated); None keeps it."""
    for i, layer in enumerate(model.model.layers):
        block = make_block(i)
        if block is not None:
            layer.mlp = block


# `<...>.experts.<expert>.<projection>.weight` (an fp8 checkpoint's: also `.weight_scale[_inv]`)
_EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight(_scale(_inv)?)?)"
)


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
            if len(seen) == stacked.shape[0] * len(self.expert_params[name.rpartition(".")[2]]):
                loaded.add(name)
        return loaded

    def _load_experts(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        shards: dict[str, set],
        fp8_parts: dict[str, dict[str, CheckpointTensor]],
        dequantized: list[str],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load per-expert tensors (recording (expert, shard) pairs); yield every other one.
        An fp8 expert weight (an fp8 checkpoint's) waits in `fp8_parts` for its scale (or the
        scale for it), then loads dequantized."""
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
            if not isinstance(experts, FusedMoE) or match["proj"] not in param_of:
                raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: no such expert weight")
            param, shard, num_shards = param_of[match["proj"]]
            expert = int(match["expert"])
            if match["kind"] != "weight" or _is_fp8(tensor):
                stem = name.rpartition(".")[0]
                fp8_parts[stem][match["kind"]] = tensor
                if len(fp8_parts[stem]) < 2:
                    continue
                try:
                    tensor = _dequantized(fp8_parts.pop(stem))
                except ValueError as exc:
                    raise ValueError(f"fp8 expert weight {stem!r}: {exc}") from None
                dequantized.append(stem)
            try:
                experts.load_expert(param, expert, shard, num_shards, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {hf_name!r}: {exc}") from None
            shards[f"{match['experts']}.{param}"].add((expert, shard))


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
