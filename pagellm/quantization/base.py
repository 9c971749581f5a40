"""The interface between a quantization method and the model: `QuantizationConfig` (one per
model: which layers it quantizes and how) and `LinearMethod` (one per quantized `Linear`).

A quantized layer runs through the attribute every `Linear` already checks on each call:
`layer.packed_weight(x, bias)` (see `pagellm/layers/linear.py`). The unquantized path is
therefore unchanged, and every `Linear` subclass (fused, column- or row-parallel) is quantized
by construction: the method sees the layer after this rank's part of each tensor is loaded.

The life of a quantized layer:

    built on `meta`            QuantizationConfig.attach(model) gives each Linear its method;
                               `create_weights(layer)` replaces `layer.weight` by what the
                               checkpoint holds (fp8 values + a scale tensor, GGUF blocks, ...)
    checkpoint tensors loaded  by name, as for any parameter (`pagellm/layers/weights.py`):
                               fused projections write their row ranges, scales included
    process_weights_after_loading(layer)
                               turns them into the kernel's layout and sets
                               `layer.packed_weight` (a `QuantizedWeight`); `layer.weight` is
                               dropped
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pagellm.layers.linear import Linear


@dataclass(frozen=True)
class QuantizedActivation:
    """A GEMM's input already quantized by the op before it (the RMSNorm or SiLU-and-mul
    kernel wrote it as fp8 with its scales: x ~ q * scale), as the weight's
    `input_quantization` asked; `Linear` passes it to its `QuantizedWeight` as it would x."""

    q: torch.Tensor  # [T, in] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] (a scale a row) or [T, in / group] float32
    dtype: torch.dtype  # of the activation it stands for: the GEMM's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class QuantizedWeight(ABC):
    """A weight in a kernel's layout: `w(x, bias)` is `F.linear(x, dequantized weight, bias)`
    up to the method's rounding. x: [T, in] (or a `QuantizedActivation`) -> [T, out] in x's
    dtype."""

    @abstractmethod
    def __call__(
        self, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def input_quantization(self, rows: int) -> int | None:
        """How this weight's GEMM quantizes an input of `rows` rows, for the op before it to
        do in its own kernel: 0 to fp8 with a scale a row, g > 0 a scale per g columns; None:
        it takes the input as it is (then no `QuantizedActivation` is passed)."""
        return None

    def silu_and_mul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """For a gate | up weight [2 I, in]: silu(gate) * up [T, I] in one kernel, where the
        method has one for this x; None otherwise (the caller runs the GEMM, then the op)."""
        return None

    def qkv_rotary_into_cache(
        self,
        x: torch.Tensor,  # [T, in]
        bias: torch.Tensor | None,
        cos_sin: torch.Tensor,  # [T, 1, head_dim]: rotary over whole heads
        num_heads: int,
        num_kv_heads: int,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [T]
        kv_scale: torch.Tensor,  # [2] k_scale, v_scale (fp8 caches)
    ) -> torch.Tensor | None:
        """For a q | k | v weight: q after rotary [T, H, D], with k (after rotary) and v
        written into the cache at `slot_mapping`, in one kernel, where the method has one for
        this x; None otherwise (the caller runs the GEMM, rotary, and attention's write)."""
        return None


class LinearMethod(ABC):
    """How one `Linear` is quantized. Stateless between layers; per-layer state lives on the
    layer (its parameters) and in the `QuantizedWeight` it builds."""

    def create_weights(self, layer: Linear) -> None:
        """Replace or add `meta` parameters for the tensors a checkpoint will hand over
        (called before loading). Default: keep the float weight (quantized after loading)."""
        return None

    @abstractmethod
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Build the layer's `QuantizedWeight` as `layer.packed_weight` from its loaded
        parameters, and drop the parameters it no longer needs."""

    def tensor_slice(self, layer: Linear, param_name: str, part: Any) -> Any:
        """The `TensorSlice` of checkpoint tensor `param_name` this rank reads, given `part`,
        the slice of the float weight it would read; None reads it whole (the default:
        methods that run on one rank)."""
        return None

    def weight_bytes(self, layer: Linear) -> int:
        """Bytes the layer holds once loaded and processed, counted on the `meta` layer
        `create_weights` left (`pagellm plan`); default: its parameters as they are."""
        return param_bytes(layer)

    def dummy_tensor(
        self, layer: Linear, param_name: str, std: float, generator: torch.Generator
    ) -> torch.Tensor | None:
        """Random values for parameter `param_name` at the checkpoint tensor's full (one-rank)
        shape, on the generator's device (`load_format="dummy"`); None: a float tensor of
        the layer's `full_shape` as for an unquantized layer (the default)."""
        return None


class QuantizedExperts(ABC):
    """A MoE layer's experts in a kernel's layout: `experts(x, weights, ids)` is the layer's
    output for routing (weights [T, K] float32, expert ids [T, K] int32) with the experts'
    weights dequantized (`pagellm.layers.moe.experts_torch`), up to the method's rounding;
    `extras`: gpt-oss's `bias13`, `bias2` and `activation`, as `experts_torch` takes them."""

    @abstractmethod
    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extras: Any
    ) -> torch.Tensor: ...


class ExpertsMethod(LinearMethod):
    """How one `FusedMoE`'s stacked experts (w13 [E, 2I, H], w2 [E, H, I]) are held: a
    `LinearMethod` for the layer whose `process_weights_after_loading` sets its
    `quantized_experts` (a `QuantizedExperts`) or leaves dequantized w13 / w2. Its
    parameters are stacked by expert, a checkpoint tensor of one expert projection loaded
    into rows of its expert's slice (`checkpoint_param`); `tensor_slice` gets the slice of
    that projection's float weight this rank would read."""

    @abstractmethod
    def checkpoint_param(self, layer: nn.Module, stacked: str, leaf: str) -> str | None:
        """The parameter that an expert projection's checkpoint tensor `leaf` ("qweight",
        "weight_scale", ...) loads into, for the projections stacked in `stacked` ("w13" or
        "w2"); None where the method has no place for it."""


class QuantizationConfig(ABC):
    """A quantization method for a whole model (one per `quantization=` name)."""

    name: ClassVar[str]

    @classmethod
    def from_model(
        cls, model_config: Any, device: torch.device, checkpoint: dict[str, Any] | None = None
    ) -> QuantizationConfig:
        """The method for a model (`pagellm.config.ModelConfig`) on `device`. `checkpoint`: its
        tensors by HF name where the loader reads them ahead (a GGUF file's, each with its
        `qtype` and `data`), else None."""
        raise NotImplementedError

    @abstractmethod
    def linear_method(self, prefix: str, layer: Linear) -> LinearMethod | None:
        """The method for the Linear named `prefix` (e.g. "model.layers.0.mlp.down_proj"), or
        None to leave it unquantized."""

    def tied_head_weight(self, embedding: torch.Tensor) -> QuantizedWeight | None:
        """A quantized LM head made from the embedding it is tied to; None keeps it as is."""
        return None

    def prepare_tensor(
        self, name: str, tensor: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Checkpoint tensor `name` as its parameter takes it: float tensors in the model's
        `dtype`, quantized values and their scales as the method wants them; None drops it."""
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def experts_method(self, prefix: str, layer: nn.Module) -> ExpertsMethod | None:
        """The method for the MoE experts named `prefix` (e.g. "model.layers.0.mlp.experts"),
        or None to keep them in the model dtype (the default)."""
        return None

    def describe(self) -> str:
        return self.name

    def attach(self, model: nn.Module) -> int:
        """Give each Linear of `model` (on `meta`) its method, but those that are not
        `quantizable` (MoE routers), and each MoE layer's experts theirs; return how many
        layers got one. A layer offers itself through a slot, its `quantizable` (`Linear`) or
        `quantizable_experts` (`FusedMoE`) attribute, and takes the method in its
        `quant_method`: this module never imports the layers."""
        count = 0
        for prefix, module in model.named_modules():
            if getattr(module, "quantizable", False):
                method = self.linear_method(prefix, module)
            elif getattr(module, "quantizable_experts", False):
                method = self.experts_method(prefix, module)
            else:
                continue
            if method is not None:
                module.quant_method = method
                method.create_weights(module)
                count += 1
        return count

    def process_weights_after_loading(self, model: nn.Module) -> None:
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if getattr(model, "tie_word_embeddings", False) and embed is not None:
            model.packed_tied_head = self.tied_head_weight(embed.weight)


def param_bytes(module: nn.Module, but: tuple[str, ...] = ()) -> int:
    """Bytes of a module's own parameters (not its children's), but those named in `but`."""
    return sum(
        p.numel() * p.element_size()
        for name, p in module.named_parameters(recurse=False)
        if name not in but
    )


def loaded_weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights once loaded (one rank's), counted on the `meta` model
    `attach` left: each quantized Linear as its method holds it, the rest as parameters (a
    tied parameter once)."""
    total, seen = 0, set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            total += method.weight_bytes(module)
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def replace_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A fresh `meta` parameter `name` on `layer` (a checkpoint tensor will be loaded into it)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    setattr(layer, name, param)


def drop_params(layer: nn.Module, *names: str) -> None:
    """Free parameters the quantized weight replaced (`Linear.forward` never reads them)."""
    for name in names:
        if name in layer._parameters:
            layer._parameters[name] = None


def checkpoint_names(prefix: str, layer) -> list[str]:
    """The checkpoint weights a Linear is loaded from: one per part of a fused projection."""
    shards = getattr(layer, "shard_rows", None)
    if not shards:
        return [f"{prefix}.weight"]
    parent = prefix.rpartition(".")[0]
    return [f"{parent}.{shard}.weight" for shard in shards]


def quant_config_dict(hf_config: Any) -> dict | None:
    """The checkpoint's `quantization_config` as a dict (None when it has none)."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None or isinstance(cfg, dict):
        return cfg
    return cfg.to_dict()
