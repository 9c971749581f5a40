"""`load_model`: build the registered model class on the `meta` device in the configured
dtype, then materialize its parameters from safetensors, GGUF or random (dummy) weights.

With tensor parallelism the model is built for this process's rank (its heads, columns and
vocabulary rows) and each rank reads only its part of each tensor: from safetensors, only
those bytes; a GGUF tensor is dequantized whole, one at a time, and then cut."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.loader.dummy_loader import init_dummy_weights
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.gguf_loader import gguf_weights
from pagellm.loader.safetensors_loader import safetensors_weights
from pagellm.loader.source import ModelSource
from pagellm.models.registry import get_model_cls
from pagellm.models.weights import CheckpointTensor, check_loaded

if TYPE_CHECKING:
    from pagellm.config import ModelConfig


def load_model(
    model_config: ModelConfig, device: torch.device, attn_backend_cls: type[AttentionBackend]
) -> nn.Module:
    device = torch.device(device)
    dtype = model_config.dtype
    model_cls = get_model_cls(model_config.architecture)
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(model_config.hf_config, attn_backend_cls)
    source = model_config.source
    if source.kind == "dummy":
        std = getattr(model_config.hf_config, "initializer_range", None) or 0.02
        init_dummy_weights(model, device, dtype, std, model_config.seed)
    else:
        weights = _on(device, dtype, iter_weights(source))
        check_loaded(model, model.load_weights(weights))
    return model.to(device).eval()  # moves the buffers built on the CPU (rotary tables)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor or safetensors slice) pairs of a gguf or hf source."""
    if source.kind == "gguf":
        return gguf_weights(read_gguf(source.path))
    if source.kind == "hf":
        return safetensors_weights(source.path)
    raise ValueError(f"a {source.kind!r} model source has no weights to read")


def _on(
    device: torch.device, dtype: torch.dtype, weights: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Each tensor read (whole, or the part this rank holds) straight to device and dtype."""
    for name, tensor in weights:
        yield name, CheckpointTensor(tensor, device, dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
