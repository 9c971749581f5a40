"""Mixture-of-experts layers: the router's top-k (`select_experts`), the experts as stacked
weights (`FusedMoE`) and the sparse MLP block of Mixtral / Qwen2-MoE / Qwen3-MoE
(`SparseMoeBlock`); per-expert checkpoint tensors are stacked at load by `moe_weights.py`.

The experts of a layer are two parameters, the expert dimension first:

    w13: [E, 2I, H]  gate_proj rows, then up_proj rows (Mixtral: w1, then w3)
    w2:  [E, H, I]   down_proj (Mixtral: w2)

Tensor parallelism splits I over the ranks: rank r holds rows [r * I / tp, (r + 1) * I / tp)
of each expert's gate and up projections (w13) and those columns of its down projection
(w2), read as slices (`FusedMoE.load_expert`); one all-reduce sums the ranks' outputs, as
for a dense MLP. The router is replicated.

On CUDA the top-k and the experts run as Triton kernels (`pagellm/kernels/fused_moe.py`: no
host sync, safe in CUDA graphs). On the CPU they are torch (`experts_torch`, in
`pagellm/kernels/moe_torch.py`): the (token, k) rows sorted by expert, one gate_up and one down
matmul per expert over its rows. That path
is the reference the kernels are tested against. Quantized experts (int4 / int8 and fp8
checkpoints on CUDA) are their method's `quantized_experts` (`pagellm/kernels/fused_moe_quant.py`;
int4 / int8 on the CPU: the torch path over each expert's blocks, `wna16_cpu.WNA16CpuExperts`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.distributed.parallel_state import all_reduce, divide, get_tp_group
from pagellm.kernels.moe_torch import experts_torch
from pagellm.layers.activation import ClampedSwiGLU
from pagellm.layers.linear import Linear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.weights import CheckpointTensor, TensorSlice, materialize
from pagellm.quantization.base import ExpertsMethod, QuantizedExperts

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


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


def check_routing(num_experts: int, top_k: int, n_group: int | None = None,
                  topk_group: int | None = None, per_group: int = 1) -> None:  # fmt: skip
    """A config's routing, checked when the model is built (it would fail at the first
    step's top-k, as HF's does): 1 <= top_k <= the experts; grouped (DeepSeek): the groups
    divide the experts, each holds `per_group` (V3 scores a group by its top two), and
    1 <= topk_group <= n_group."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k}: a token routes to 1 to {num_experts} "
                         f"experts (the config's)")  # fmt: skip
    if n_group is None:
        return
    if n_group < 1 or num_experts % n_group or num_experts // n_group < per_group:
        raise ValueError(f"n_group={n_group} must divide the {num_experts} routed experts into "
                         f"groups of at least {per_group}")  # fmt: skip
    if not 1 <= (topk_group or 0) <= n_group:
        raise ValueError(f"topk_group={topk_group} must be 1 to n_group={n_group}")


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


class FusedMoE(nn.Module):
    """A layer's experts as stacked weights, and the routing of tokens to them. A
    quantization method (`quant_method`, attached on `meta` through the
    `quantizable_experts` slot) may replace w13 / w2 by its own stacked tensors (named
    `w13_<role>`, `w2_<role>`) and, after loading, run them as `quantized_experts`."""

    quantizable_experts = True
    quant_method: ExpertsMethod | None = None
    quantized_experts: QuantizedExperts | None = None

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        bias: bool = False,  # gpt-oss: w13_bias [E, 2I], w2_bias [E, H]
        activation: ClampedSwiGLU | None = None,  # None: SiLU(gate) * up
    ) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, divide(intermediate_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.activation = activation
        check_routing(num_experts, top_k)
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts, self.hidden_size = e, h
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
        return self.run(x, weights, ids)

    def run(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, K] float32: each chosen expert's weight
        ids: torch.Tensor,  # [T, K] int32 expert ids
    ) -> torch.Tensor:  # [T, H]
        """The experts on routing chosen elsewhere (DeepSeek's grouped top-k)."""
        kernels = _kernels(x)
        if self.quantized_experts is not None:
            out = self.quantized_experts(x, weights, ids, **self._extras())
        elif kernels is not None:
            out = kernels.fused_moe(x, self.w13, self.w2, weights, ids, **self._extras())
        else:
            out = experts_torch(x, self.w13, self.w2, weights, ids, **self._extras())
        return all_reduce(out) if self.reduce else out

    def _extras(self) -> dict:
        """gpt-oss's biases and activation, for the experts' function (none: Mixtral's)."""
        if self.w13_bias is None and self.activation is None:
            return {}
        return dict(bias13=self.w13_bias, bias2=self.w2_bias, activation=self.activation)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """The shape with one rank (random weights are drawn at it, then cut)."""
        e, h, i = self.num_experts, self.hidden_size, self.full_intermediate
        shapes = {"w13": (e, 2 * i, h), "w13_bias": (e, 2 * i), "w2_bias": (e, h)}
        return shapes.get(param_name, (e, h, i))

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        """Load every expert from a tensor of one rank's shape (`full_shape`, or a quantized
        parameter's): this rank's part of each."""
        shards = tensor.chunk(2, dim=1) if param_name.startswith("w13") else (tensor,)
        for expert in range(tensor.shape[0]):
            for shard, rows in enumerate(shards):
                self.load_expert(param_name, expert, shard, len(shards), rows[expert])

    def checkpoint_param(self, stacked: str, leaf: str) -> str | None:
        """The parameter an expert projection's checkpoint tensor `leaf` loads into (see
        `ExpertsMethod.checkpoint_param`): `stacked` itself for a float "weight"."""
        if self.quant_method is not None:
            return self.quant_method.checkpoint_param(self, stacked, leaf)
        return stacked if leaf == "weight" else None

    def load_expert(
        self, param_name: str, expert: int, shard: int, num_shards: int, tensor: torch.Tensor
    ) -> None:
        """Write this rank's part of one expert's checkpoint projection into row block `shard`
        of `num_shards` of its stacked parameter (w13: gate 0, up 1 of 2; w2: down, 0 of 1)."""
        if not isinstance(tensor, CheckpointTensor):
            tensor = CheckpointTensor(tensor)
        part = (
            self.part
            if param_name.startswith("w13")
            else TensorSlice(1, self.part.start, self.part.size)
        )
        if self.quant_method is not None:  # its tensors' parts of this rank's rows / columns
            part = self.quant_method.tensor_slice(self, param_name, part)
        if param_name == "w2_bias":  # whole on rank 0, zeros elsewhere: the all-reduce sums
            part = None
        tensor = tensor.read(part if self.reduce else None)
        if param_name == "w2_bias" and get_tp_group().rank > 0:
            tensor = torch.zeros_like(tensor)
        param = materialize(self, param_name, tensor.device)
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"expert {expert} of {param_name}: the layer has {param.shape[0]}")
        rows = param.shape[1] // num_shards
        target = param.data[expert, shard * rows : (shard + 1) * rows]
        if tensor.dim() == 0 and target.dim():  # a per-tensor scale fills its shard's rows
            tensor = tensor.expand(target.shape)
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
