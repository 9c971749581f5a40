"""Linear layers: replicated, and split over the tensor-parallel ranks (vLLM's layout).

    ColumnParallelLinear  y_r = x @ W[rows of rank r]^T       output features split, no comm
    FusedLinear           several projections stacked (q|k|v, gate|up), each split by rows
    QKVParallelLinear     q heads split; k/v heads split, or replicated when fewer than ranks
    RowParallelLinear     y = sum_r x_r @ W[:, cols of rank r]^T   input split, one all-reduce

A column-parallel projection feeds a row-parallel one (qkv -> attention -> o_proj, gate_up ->
SiLU-and-mul -> down_proj), so each pair costs one all-reduce. Each module names the part of
a checkpoint tensor it holds (`checkpoint_slice`) and the full shape it was cut from
(`full_shape`, for random weights that are the same whatever the number of ranks). With one
rank every class is a plain `Linear`.

On x86 CPUs the model runner pre-packs every `Linear` weight once (`Linear.prepack`) for the
GEMM library that is fastest on this machine (`pagellm/kernels/cpu_gemm.py`: MKL or oneDNN,
bf16 or float32 arithmetic, timed at start-up); the plain weight is then freed.

A quantized layer's tensors have their method's shapes; its method says which part of each
a rank reads (`LinearMethod.tensor_slice`: whole for fp8 and GGUF, which run on one rank;
rows or whole groups of columns for int4 / int8 checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.parallel_state import all_reduce, divide, get_tp_group
from pagellm.kernels.cpu_gemm import PackedWeight
from pagellm.layers.weights import CheckpointTensor, TensorSlice, materialize
from pagellm.quantization.base import LinearMethod, QuantizedWeight


class Linear(nn.Linear):
    """nn.Linear that can run from a pre-packed CPU weight (see `prepack`) or a quantized one
    (`quant_method`, `pagellm/quantization/base.py`): either is `packed_weight(x, bias)`.
    A quantized layer reads the part of each checkpoint tensor its method says
    (`quantized_slice`)."""

    packed_weight: PackedWeight | QuantizedWeight | None = None
    quant_method: LinearMethod | None = None  # set before loading; builds packed_weight after
    quantizable = True  # False: no quantization method is attached (MoE routers, as vLLM's)
    per_part_params: tuple[str, ...] = ()  # a quantized fused layer's: one row a part
    # LoRA adapters' slots (`pagellm.lora.layers.LoRASlots`): lora(x, out) adds each row's delta
    lora = None

    def reset_parameters(self) -> None:
        """No random init: weights come from a checkpoint or the dummy loader. (On `meta`,
        nn.Linear's init goes through torch's reference ops, whose first use imports
        torch._dynamo: 1-7 s of start-up.)"""

    def prepack(self, batch_hint: int) -> None:
        """Keep only a packed copy of the weight (x86 CPUs; see the module doc)."""
        if self.packed_weight is not None:  # quantized: already in its kernel's layout
            return
        self.packed_weight = PackedWeight(self.weight, batch_hint)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            out = self.packed_weight(x, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)


def quantized_slice(layer: Linear, param_name: str, part: TensorSlice) -> TensorSlice | None:
    """The part of checkpoint tensor `param_name` this rank reads: `part` (the float weight's
    rows or columns), or what the layer's quantization method makes of it (None: whole)."""
    if layer.quant_method is None:
        return part
    return layer.quant_method.tensor_slice(layer, param_name, part)


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: rank r holds rows [r * n, (r + 1) * n) of the
    checkpoint's weight and bias (n = out_features / tp; or the rows `part` names) and
    computes those features."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, part: TensorSlice | None = None
    ) -> None:
        if part is None:
            n = divide(out_features, "out_features")
            part = TensorSlice(0, get_tp_group().rank * n, n)
        super().__init__(in_features, part.size, bias=bias)
        self.part = part
        self.full_out_features = out_features

    def checkpoint_slice(self, param_name: str) -> TensorSlice | None:
        return quantized_slice(self, param_name, self.part)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.full_out_features, self.in_features)[: getattr(self, param_name).dim()]


class FusedLinear(Linear):
    """A column-parallel layer whose output rows stack several checkpoint projections (vLLM's
    MergedColumnParallelLinear).

    `shards` maps each checkpoint projection (e.g. "q_proj") to its full number of output
    rows, in stacking order; each rank holds 1/tp of every projection (`parts`: what it takes
    from each; QKVParallelLinear overrides them). `load_shard` writes one projection's part
    into its row range.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        rank = get_tp_group().rank
        parts = {}
        for name, rows in shards.items():
            n = divide(rows, f"the rows of {name}")
            parts[name] = TensorSlice(0, rank * n, n)
        self._init_parts(in_features, shards, parts, bias)

    def _init_parts(
        self, in_features: int, shards: dict[str, int], parts: dict[str, TensorSlice], bias: bool
    ) -> None:
        super().__init__(in_features, sum(p.size for p in parts.values()), bias=bias)
        self.full_rows = dict(shards)  # projection -> rows in the checkpoint
        self.parts = parts  # projection -> the rows of it this rank holds
        starts = [0]
        for part in parts.values():
            starts.append(starts[-1] + part.size)
        self.shard_rows = {name: (starts[i], starts[i + 1]) for i, name in enumerate(parts)}

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """The shape with one rank: every projection's rows stacked."""
        rows = sum(self.full_rows.values())
        return (rows, self.in_features)[: getattr(self, param_name).dim()]

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        """Load from a tensor of `full_shape` (random weights, a fused checkpoint tensor):
        each projection's part (a per-part parameter's one row: each part's own)."""
        if param_name in self.per_part_params:
            for shard in self.full_rows:
                self.load_shard(param_name, shard, tensor)
            return
        for shard, rows in zip(self.full_rows, tensor.split(list(self.full_rows.values()))):
            self.load_shard(param_name, shard, rows)

    def load_shard(
        self, param_name: str, shard: str, tensor: torch.Tensor | CheckpointTensor
    ) -> None:
        if not isinstance(tensor, CheckpointTensor):
            tensor = CheckpointTensor(tensor)
        if self.quant_method is None:  # a quantization method's tensors have their own shapes
            full = (self.full_rows[shard], self.in_features)[: getattr(self, param_name).dim()]
            if tensor.shape != full:  # checked whole: a rank's slice of a wrong shape may fit
                raise ValueError(f"{shard}.{param_name}: expected {full}, got {tensor.shape}")
        rows = tensor.read(quantized_slice(self, param_name, self.parts[shard]))
        param = materialize(self, param_name, rows.device)
        start, end = self.shard_rows[shard]
        if param_name in self.per_part_params:  # a row a part (act-order g_idx)
            start = list(self.shard_rows).index(shard)
            end = start + 1
        elif param.dim() and param.shape[0] != self.out_features:  # block scales: rows per block
            block = -(-self.out_features // param.shape[0])
            start, end = start // block, -(-end // block)
        if rows.dim() == 0 and param.dim():  # a per-tensor scale fills its shard's rows
            rows = rows.expand(param[start:end].shape)
        if rows.shape != param[start:end].shape:
            raise ValueError(
                f"{shard}.{param_name}: expected {tuple(param[start:end].shape)}, "
                f"got {tuple(rows.shape)} (of {tensor.shape})"
            )
        param.data[start:end].copy_(rows)


class QKVParallelLinear(FusedLinear):
    """q, k and v stacked; each rank holds num_heads / tp query heads and num_kv_heads / tp
    key/value heads, or, with fewer KV heads than ranks, one KV head that tp / num_kv_heads
    ranks share (a copy each)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
    ) -> None:
        q_heads, kv_heads = heads_per_rank(num_heads, num_kv_heads)
        tp = get_tp_group()
        # the first KV head of this rank; shared by tp / num_kv_heads ranks when replicated
        kv_head = tp.rank * num_kv_heads // tp.size
        kv = TensorSlice(0, kv_head * head_dim, kv_heads * head_dim)
        parts = {"q_proj": TensorSlice(0, tp.rank * q_heads * head_dim, q_heads * head_dim)}
        parts.update(k_proj=kv, v_proj=kv)
        shards = {"q_proj": num_heads * head_dim}
        shards.update(k_proj=num_kv_heads * head_dim, v_proj=num_kv_heads * head_dim)
        self._init_parts(hidden_size, shards, parts, bias)
        self.num_heads, self.num_kv_heads = q_heads, kv_heads  # this rank's


def heads_per_rank(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank; KV heads are replicated when fewer than ranks."""
    tp = get_tp_group().size
    q_heads = divide(num_heads, "num_attention_heads")
    if num_kv_heads >= tp:
        return q_heads, divide(num_kv_heads, "num_key_value_heads")
    if tp % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size={tp} "
            "when it is smaller"
        )
    return q_heads, 1


class RowParallelLinear(Linear):
    """Input features split over the ranks: rank r holds columns [r * n, (r + 1) * n) of the
    checkpoint's weight (n = in_features / tp) and multiplies its slice of the input; one
    all-reduce sums the partial outputs. The bias is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        n = divide(in_features, "in_features")
        super().__init__(n, out_features, bias=bias)
        tp = get_tp_group()
        self.part = TensorSlice(1, tp.rank * n, n)
        self.full_in_features = in_features
        self.reduce = tp.size > 1
        self.adds_bias = tp.rank == 0

    def checkpoint_slice(self, param_name: str) -> TensorSlice | None:
        return None if param_name == "bias" else quantized_slice(self, param_name, self.part)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        if param_name == "bias":
            return (self.out_features,)
        return (self.out_features, self.full_in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / tp] -> [T, out]; with one rank, exactly Linear.forward
        bias = self.bias if self.adds_bias else None
        if self.packed_weight is not None:
            out = self.packed_weight(x, bias)
        else:
            out = F.linear(x, self.weight, bias)
        if self.lora is not None:  # this rank's partial delta: summed by the all-reduce
            out = self.lora(x, out)
        return all_reduce(out) if self.reduce else out
