"""Random weights for benchmarks at real shapes: normal(0, std) matrices, RMSNorm weights 1,
biases 0, drawn from one generator seeded by the model config's seed; a quantized layer's
tensors as its method draws them (int4 / int8 checkpoints: random integers with scales that
give about the same std, `LinearMethod.dummy_tensor`).

Every parameter is drawn at its full (one-rank) shape and this rank keeps its part, so a
model split over any number of tensor-parallel ranks is the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.weights import load_param


def init_dummy_weights(
    model: nn.Module, device: torch.device, dtype: torch.dtype, std: float, seed: int
) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        for name, _ in list(module.named_parameters(recurse=False)):
            tensor = None
            if method is not None:
                tensor = method.dummy_tensor(module, name, std, generator)
            if tensor is None:
                tensor = _float_tensor(module, name, device, dtype, std, generator)
            if hasattr(module, "load_full"):  # FusedLinear, FusedMoE: several parts
                module.load_full(name, tensor)
            else:
                load_param(module, name, tensor)


def _float_tensor(module: nn.Module, name: str, device: torch.device, dtype: torch.dtype,
                  std: float, generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    shape = (
        module.full_shape(name) if hasattr(module, "full_shape") else getattr(module, name).shape
    )
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if isinstance(module, RMSNorm):
        return tensor.fill_(1.0)
    if name == "bias":
        return tensor.zero_()
    return tensor.normal_(0.0, std, generator=generator)
