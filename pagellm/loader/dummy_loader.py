"""Random weights for benchmarks at real shapes: normal(0, std) matrices, RMSNorm weights 1,
biases 0, drawn from one generator seeded by the model config's seed.

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
        for name, param in list(module.named_parameters(recurse=False)):
            shape = module.full_shape(name) if hasattr(module, "full_shape") else param.shape
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if isinstance(module, RMSNorm):
                tensor.fill_(1.0)
            elif name == "bias":
                tensor.zero_()
            else:
                tensor.normal_(0.0, std, generator=generator)
            if hasattr(module, "load_full"):  # FusedLinear, FusedMoE: several parts
                module.load_full(name, tensor)
            else:
                load_param(module, name, tensor)
