"""`quantization="awq" | "gptq" | "compressed-tensors"` (pack-quantized): int4 / int8
weight-only checkpoints (W4A16, W8A16), loaded as stored and served quantized.

Each checkpoint tensor is turned into the canonical layout as it is read (`prepare_tensor`,
`wna16_formats.py`: output rows first), so fused projections stack their parts by rows and
tensor-parallel ranks take rows (column-parallel) or whole groups of columns (row-parallel;
a split inside a group is a ValueError naming the layer). After loading, per layer:

    act-order (g_idx)   the input columns are sorted by group once (`perm`; x is gathered by
                        it at run time) where every part of a fused projection shares it and
                        the groups come out whole; otherwise the layer is dequantized
    CUDA                `WNA16GpuWeight`: Triton w4a16 / w8a16 (`pagellm/kernels/wna16_gemm.py`)
    CPU                 int4 groups of a multiple of 32 (and 8-bit symmetric) as GGUF-style
                        blocks for the block kernel at decode sizes, a dequantized copy for
                        larger batches (`wna16_cpu.py`); other layouts dequantized at load
    quantization="none" every layer dequantized at load (the model dtype)

The LM head, embeddings, MoE routers and the layers the config ignores stay unquantized.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace  # of a TensorSlice (pagellm/layers/weights.py, a floor above)

import torch
from torch import nn

from pagellm.quantization.base import (
    ExpertsMethod,
    LinearMethod,
    QuantizationConfig,
    QuantizedWeight,
    checkpoint_names,
    drop_params,
    param_bytes,
    quant_config_dict,
    replace_param,
)
from pagellm.quantization.cpu_int import DenseCopies
from pagellm.quantization.wna16_formats import (
    WNA16Scheme,
    dequantize,
    parse_scheme,
    permute_columns,
    random_canonical,
    sort_groups,
    to_canonical,
    unpermuted,
)

logger = logging.getLogger(__name__)


class WNA16LinearMethod(LinearMethod):
    """One Linear's int weights: canonical parameters while loading, then the kernel's."""

    def __init__(self, config: WNA16Config, scheme: WNA16Scheme) -> None:
        self.config = config
        self.scheme = scheme  # the config's, or a per-module rule's (`WNA16Scheme.for_module`)

    def create_weights(self, layer) -> None:
        # the checkpoint's names (qweight, weight_packed, ...) for the canonical tensors
        s, n, k = self.scheme, layer.out_features, layer.in_features
        groups = self._local_groups(layer)
        shapes = {"qweight": ((n, k * s.bits // 8), torch.uint8),
                  "scales": ((n, groups), torch.float32)}  # fmt: skip
        if s.has_zeros:
            shapes["zeros"] = ((n, groups), torch.uint8)
        if s.act_order:  # one row a fused part (FusedLinear.load_shard)
            parts = len(getattr(layer, "shard_rows", None) or ()) or 1
            shapes["g_idx"] = ((parts, k), torch.int32)
            layer.per_part_params = (s.names["g_idx"],)
        for role, (shape, dtype) in shapes.items():
            replace_param(layer, s.names[role], shape, dtype)
        drop_params(layer, "weight")

    def _take(self, layer, role: str) -> torch.Tensor | None:
        """The loaded canonical tensor of `role`, dropped from the layer (None: not stored)."""
        name = self.scheme.names.get(role)
        param = layer._parameters.get(name) if name else None
        if param is None:
            return None
        drop_params(layer, name)
        return param.detach()

    def _local_groups(self, layer) -> int:
        """Scale groups this rank holds: all of them where the input is whole (or act-order
        or one group), else its columns' (a row-parallel split on group boundaries)."""
        s, k = self.scheme, layer.in_features
        full_k = getattr(layer, "full_in_features", k)
        if full_k == k or s.act_order or s.group_size == -1:
            return s.groups(full_k)
        if k % s.group_size:
            raise ValueError(
                f"tensor parallel: {full_k} input columns split into {k} per rank, not a "
                f"multiple of the checkpoint's group_size {s.group_size} (a {s.method} "
                f"row-parallel layer splits on group boundaries); use fewer ranks"
            )
        return k // s.group_size

    def tensor_slice(self, layer, param_name: str, part):
        """This rank's part of a canonical tensor, from the `TensorSlice` of the float weight
        (rows: the same rows; columns: their bytes, groups or g_idx entries)."""
        if part.dim == 0:
            return None if param_name == self.scheme.names.get("g_idx") else part
        role = {v: k for k, v in self.scheme.names.items()}.get(param_name)
        if role == "qweight":
            per = 8 // self.scheme.bits
            return replace(part, start=part.start // per, size=part.size // per)
        if role == "g_idx":
            return part
        scales = getattr(layer, self.scheme.names["scales"])
        if scales.shape[1] == self.scheme.groups(layer.full_in_features):
            return None  # every group (act-order, one group)
        size = self.scheme.group_size
        return replace(part, start=part.start // size, size=part.size // size)

    def process_weights_after_loading(self, layer) -> None:
        s = self.scheme
        qweight, scales = self._take(layer, "qweight"), self._take(layer, "scales")
        zeros, g_idx = self._take(layer, "zeros"), self._take(layer, "g_idx")
        if zeros is None:
            zeros = torch.full(scales.shape, s.offset, dtype=torch.uint8, device=scales.device)
        group = s.group(layer.in_features)
        perm = None
        if g_idx is not None and all(torch.equal(g_idx[0], row) for row in g_idx):
            perm = sort_groups(g_idx[0], group)
            if perm is not None:
                qweight, g_idx = permute_columns(qweight, s.bits, perm), None
        weight = None
        if g_idx is None and not self.config.dequantize and not getattr(layer, "dense_only", False):
            weight = self.config.kernel_weight(qweight, scales, zeros, s.bits, group, perm)
        if weight is None:  # dequantized: the runner packs it like any float weight
            dense = self._dequantized(layer, qweight, scales, zeros, group, g_idx, perm)
            layer.weight = nn.Parameter(dense.to(self.config.dtype), requires_grad=False)
            return
        layer.packed_weight = weight

    def _dequantized(self, layer, qweight, scales, zeros, group, g_idx, perm) -> torch.Tensor:
        bits = self.scheme.bits
        if g_idx is None:
            return unpermuted(dequantize(qweight, scales, zeros, bits, group), perm)
        rows = list((getattr(layer, "shard_rows", None) or {"": (0, qweight.shape[0])}).values())
        return torch.cat([
            dequantize(qweight[a:b], scales[a:b], zeros[a:b], bits, group, g_idx[i])
            for i, (a, b) in enumerate(rows)
        ])  # fmt: skip

    def dummy_tensor(self, layer, param_name: str, std: float, generator) -> torch.Tensor | None:
        role = {v: k for k, v in self.scheme.names.items()}.get(param_name)
        if role is None:
            return None  # a bias
        full_rows = getattr(layer, "full_rows", None)
        n = sum(full_rows.values()) if full_rows else getattr(layer, "full_out_features",
                                                              layer.out_features)  # fmt: skip
        k = getattr(layer, "full_in_features", layer.in_features)
        return random_canonical(self.scheme, role, n, k, std, generator)

    def weight_bytes(self, layer) -> int:
        # the int weight and its scales; on the CPU also the dequantized copy
        n, k = layer.out_features, layer.in_features
        names = self.scheme.names
        rest = param_bytes(layer, but=tuple(names.values()))
        dense = n * k * self.config.dtype.itemsize
        if self.config.dequantize:
            return rest + dense
        quantized = n * k * self.scheme.bits // 8 + getattr(layer, names["scales"]).numel() * 8
        copy = self.config.device.type == "cpu" and self.config.copies.keep()
        return rest + quantized + (dense if copy else 0)


class WNA16Config(QuantizationConfig):
    """AWQ / GPTQ / compressed-tensors pack-quantized checkpoints (see the module doc)."""

    def __init__(self, scheme: WNA16Scheme, dtype: torch.dtype, device: torch.device,
                 dequantize: bool) -> None:  # fmt: skip
        self.scheme = scheme
        self.name = scheme.method
        self.dtype = dtype
        self.device = device
        self.dequantize = dequantize
        # one method a scheme (GPTQ `dynamic` rules give some modules their own)
        self.methods = {scheme.key: WNA16LinearMethod(self, scheme)}
        self.shapes: dict[str, tuple[int, int]] = {}  # checkpoint module -> full (N, K)
        self.module_schemes: dict[str, WNA16Scheme] = {}  # checkpoint module -> its scheme
        self.kernels: dict[str, int] = {}  # what served the layers, for the log
        self.copies = DenseCopies()  # CPU: whether the block layers keep a dequantized copy
        # MoE experts: our experts module -> {stacked: one expert projection's full (N, K)}
        self.expert_shapes: dict[str, dict[str, tuple[int, int]]] = {}
        self.expert_names: tuple[dict[str, str], dict[str, str]] = ({}, {})  # renames, stacks

    @classmethod
    def from_model(cls, model_config, device: torch.device, checkpoint=None) -> WNA16Config:
        scheme = parse_scheme(quant_config_dict(model_config.hf_config) or {})
        dequantize = model_config.quantization is None
        if dequantize:
            logger.info("%s checkpoint with quantization='none': weights dequantized to %s "
                        "at load", scheme.method, model_config.dtype)  # fmt: skip
        return cls(scheme, model_config.dtype, torch.device(device), dequantize)

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if prefix.rpartition(".")[2] == "lm_head" and not self.scheme.lm_head:
            return None
        if self._ignored(prefix, layer):
            return None
        scheme = self._layer_scheme(prefix, layer)
        if scheme is None:  # a `dynamic` rule leaves it unquantized
            return None
        k = getattr(layer, "full_in_features", layer.in_features)
        full_rows = getattr(layer, "full_rows", None)
        n = getattr(layer, "full_out_features", layer.out_features)
        self.shapes[prefix] = (sum(full_rows.values()) if full_rows else n, k)
        if self.device.type == "cpu" and not self.dequantize:
            self.copies.count(layer.out_features, layer.in_features, self.dtype)
        self.module_schemes[prefix] = scheme
        for name, rows in (full_rows or {}).items():
            self.shapes[f"{prefix.rpartition('.')[0]}.{name}"] = (rows, k)
            self.module_schemes[f"{prefix.rpartition('.')[0]}.{name}"] = scheme
        if scheme.key not in self.methods:
            self.methods[scheme.key] = WNA16LinearMethod(self, scheme)
        return self.methods[scheme.key]

    def _layer_scheme(self, prefix: str, layer) -> WNA16Scheme | None:
        """A layer's scheme by its checkpoint modules' names (`WNA16Scheme.for_module`: GPTQ's
        `dynamic` rules, compressed-tensors' config groups); a fused layer's parts agree."""
        if not self.scheme.overrides:
            return self.scheme
        parts = {n.removesuffix(".weight"): None for n in checkpoint_names(prefix, layer)}
        for name in parts:
            parts[name] = self.scheme.for_module(name)
        settings = {name: s.key if s else "unquantized" for name, s in parts.items()}
        if len(set(settings.values())) > 1:
            raise ValueError(
                f"{prefix}: the checkpoint's per-module settings (GPTQ dynamic rules, "
                f"compressed-tensors config groups) set the parts of this fused layer apart "
                f"({settings}: bits, group_size, sym, act-order); they are served as one layer"
            )
        return next(iter(parts.values()))

    def attach(self, model: nn.Module) -> int:
        # a MoE model's checkpoint names for its experts (`MoEWeights`): the tensors are
        # read by their HF names, before the model renames them
        stacks = getattr(model, "expert_params", {})
        projections = {proj: stacked for stacked, projs in stacks.items() for proj in projs}
        for alias, proj in getattr(model, "expert_aliases", {}).items():
            if proj in projections:
                projections[alias] = projections[proj]
        self.expert_names = (getattr(model, "checkpoint_renames", {}), projections)
        return super().attach(model)

    def experts_method(self, prefix: str, layer) -> ExpertsMethod | None:
        from pagellm.quantization.wna16_moe import WNA16ExpertsMethod

        h, i = layer.hidden_size, layer.full_intermediate
        self.expert_shapes[prefix] = {"w13": (i, h), "w2": (h, i)}
        return WNA16ExpertsMethod(self)

    def _expert_shape(self, module: str) -> tuple[int, int] | None:
        """One expert projection's full (N, K) for its checkpoint module name, or None."""
        renames, projections = self.expert_names
        for old, new in renames.items():
            module = module.replace(old, new)
        experts, _, rest = module.rpartition(".experts.")
        stacked = projections.get(rest.partition(".")[2])
        shapes = self.expert_shapes.get(f"{experts}.experts")
        return shapes[stacked] if shapes and stacked else None

    def _ignored(self, prefix: str, layer) -> bool:
        """Whether the config leaves the layer unquantized. An entry names a module, its last
        names ("down_proj") or a module above it ("model.layers.1", as transformers reads
        modules_to_not_convert); "re:" patterns match from the name's start (compressed-
        tensors' re.match). A fused layer is left whole or not at all: by its own name (a
        checkpoint storing it fused: Phi-3's qkv_proj) or every part's."""
        parts = [n.removesuffix(".weight") for n in checkpoint_names(prefix, layer)]
        if self._listed(prefix):
            return True
        listed = [n for n in parts if self._listed(n)]
        if listed and len(listed) < len(parts):
            raise ValueError(
                f"{prefix}: the {self.name} config leaves {listed} unquantized but not the "
                f"other parts of the fused layer ({sorted(set(parts) - set(listed))})"
            )
        return bool(listed)

    def _listed(self, module: str) -> bool:
        for entry in self.scheme.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif (
                module == entry
                or module.endswith("." + entry)
                or module.startswith(entry.rstrip(".") + ".")
            ):
                return True
        return False

    def prepare_tensor(self, name: str, tensor: torch.Tensor, dtype: torch.dtype):
        module, _, leaf = name.rpartition(".")
        shape = self.shapes.get(module)
        scheme = self.module_schemes.get(module, self.scheme)
        if shape is None and (shape := self._expert_shape(module)) is not None:
            found = self.scheme.for_module(module)
            if found is None or found.key != self.scheme.key:
                raise ValueError(f"{name}: the checkpoint gives this MoE expert settings of its "
                                 "own (a GPTQ dynamic rule, a compressed-tensors config group); "
                                 "experts are served with the config's main ones")  # fmt: skip
        if shape is None:  # an unquantized layer's or a norm's tensor
            return tensor.to(dtype) if tensor.is_floating_point() else tensor
        if leaf == "weight_shape":
            if [int(v) for v in tensor.reshape(-1)] != list(shape):
                raise ValueError(f"{name}: the checkpoint says {tensor.tolist()}, the model's "
                                 f"layer is {list(shape)}")  # fmt: skip
            return None
        role = {v: k for k, v in scheme.names.items()}.get(leaf)
        if role == "g_idx" and not scheme.act_order:
            # without act-order the groups are k // group_size (as vLLM reads it): a g_idx
            # saying otherwise is a config that lost its act-order, not one to drop silently
            trivial = torch.arange(shape[1]) // scheme.group(shape[1])
            if tuple(tensor.shape) != (shape[1],) or not torch.equal(tensor.long(), trivial):
                groups = int(tensor.max()) + 1 if tensor.numel() else 0
                other = -(-shape[1] // groups) if groups else 0
                if other and torch.equal(tensor.long(), torch.arange(shape[1]) // other):
                    raise ValueError(
                        f"{name}: this g_idx puts the inputs in groups of {other}, the "
                        f"{self.name} config's group_size is {scheme.group_size}"
                    )
                raise ValueError(
                    f"{name}: the {self.name} config states no act-order (desc_act / actorder) "
                    f"but this g_idx is not k // group_size"
                )
            return None
        if role is None:
            if leaf == "weight" and tensor.is_floating_point():
                raise ValueError(f"{name}: a float weight where the {self.name} checkpoint's "
                                 f"layer should hold {scheme.names['qweight']!r}")  # fmt: skip
            return tensor.to(dtype) if tensor.is_floating_point() else tensor
        return to_canonical(scheme, role, name, tensor, *shape)

    def kernel_weight(self, qweight, scales, zeros, bits, group, perm) -> QuantizedWeight | None:
        """The weight for this device's kernels (groups contiguous; act-order columns
        sorted by `perm`), or None where they cannot take it (then the layer is dequantized)."""
        if self.device.type == "cuda":
            from pagellm.quantization.wna16_gpu import gpu_weight

            weight = gpu_weight(qweight, scales, zeros, bits, group, perm)
        else:
            from pagellm.quantization.wna16_cpu import cpu_weight

            copy = self.copies.keep()
            weight = cpu_weight(qweight, scales, zeros, bits, group, perm, self.dtype, copy)
        kind = type(weight).__name__ if weight is not None else "dequantized"
        self.kernels[kind] = self.kernels.get(kind, 0) + 1
        return weight

    def experts_weight(self, stacks: dict[str, dict[str, torch.Tensor]]):
        """A MoE layer's int experts for this device's kernels (`QuantizedExperts`), or None
        (dequantized: act-order, groups the kernel cannot take, no CPU block kernel)."""
        if any("g_idx" in t for t in stacks.values()):
            kind = None
        elif self.device.type == "cuda":
            from pagellm.quantization.wna16_gpu import gpu_experts

            kind = gpu_experts(stacks, self.scheme.bits, self.scheme.group_size)
        else:
            from pagellm.quantization.wna16_cpu import cpu_experts

            kind = cpu_experts(stacks, self.scheme.bits, self.scheme.group_size)
        name = "experts " + (type(kind).__name__ if kind is not None else "dequantized")
        self.kernels[name] = self.kernels.get(name, 0) + 1
        return kind

    def process_weights_after_loading(self, model: nn.Module) -> None:
        super().process_weights_after_loading(model)
        if self.kernels:
            logger.info("%s layers: %s", self.name,
                        ", ".join(f"{n} {k}" for k, n in sorted(self.kernels.items())))  # fmt: skip

    def describe(self) -> str:
        s = self.scheme
        group = "channel" if s.group_size == -1 else f"group {s.group_size}"
        how = "dequantized at load" if self.dequantize else "int weights kept"
        extra = ", act-order" if s.act_order else ""
        zeros = "symmetric" if s.sym else "zero points"
        if s.overrides:  # GPTQ's dynamic rules, compressed-tensors' config groups
            extra += f", {len(s.overrides)} per-module rule{'s' * (len(s.overrides) > 1)}"
        return f"{s.method} ({s.bits}-bit, {group}, {zeros}{extra}; {how})"
