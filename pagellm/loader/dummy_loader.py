"""Random weights for benchmarks at real shapes: normal(0, std) matrices, RMSNorm weights 1,
biases 0, drawn from one generator seeded by the model config's seed."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.models.layers import RMSNorm
from pagellm.models.weights import set_param


def init_dummy_weights(
    model: nn.Module, device: torch.device, dtype: torch.dtype, std: float, seed: int
) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            tensor = torch.empty(param.shape, dtype=dtype, device=device)
            if isinstance(module, RMSNorm):
                tensor.fill_(1.0)
            elif name == "bias":
                tensor.zero_()
            else:
                tensor.normal_(0.0, std, generator=generator)
            set_param(module, name, tensor)
