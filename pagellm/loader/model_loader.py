"""`load_model`: build the registered model class on the `meta` device in the configured
dtype (with tensor parallelism: this process's rank, its heads, columns and vocabulary
rows), check the checkpoint's tensor names and shapes against it (headers only, on `meta`: a
mismatch is a ValueError naming the file and the tensor before any weight reaches the device),
then materialize its parameters from safetensors / .bin, GGUF or random (dummy) weights. Each
rank reads only its part of each tensor: from safetensors, only those bytes; a `.bin` or GGUF
tensor is read (dequantized) whole, one at a time, and then cut. With a quantization method,
its Linears are given their methods before loading and their quantized weights built after it
(`pagellm/quantization/base.py`); the meta check is skipped then (quantized tensors have their
method's shapes), and quantization runs on one rank only."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.kv_cache_dtype import checkpoint_kv_scale
from pagellm.layers.moe import FusedMoE
from pagellm.layers.weights import CheckpointTensor, check_loaded
from pagellm.loader.dummy_loader import init_dummy_weights
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.gguf_loader import gguf_shapes, gguf_tensors, gguf_weights
from pagellm.loader.safetensors_loader import (
    checkpoint_files,
    checkpoint_shapes,
    hf_folder_weights,
)
from pagellm.loader.source import ModelSource
from pagellm.models.registry import get_model_cls
from pagellm.quantization import get_quant_config

if TYPE_CHECKING:
    from pagellm.config import ModelConfig
    from pagellm.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


def load_model(
    model_config: ModelConfig, device: torch.device, attn_backend_cls: type[AttentionBackend]
) -> nn.Module:
    device = torch.device(device)
    dtype = model_config.dtype
    source = model_config.source
    model, quant = build_on_meta(model_config, device, attn_backend_cls)
    if source.kind == "dummy":
        std = getattr(model_config.hf_config, "initializer_range", None) or 0.02
        init_dummy_weights(model, device, dtype, std, model_config.seed)
    else:
        if quant is None:
            check_checkpoint(model, source)
        current = [""]  # the tensor being read: quantized tensors are not dry-run above

        def tracked() -> Iterator[tuple[str, Any]]:
            for name, tensor in iter_weights(source, quant):
                current[0] = name
                yield name, tensor
            current[0] = ""  # all read: an error after this is not the last tensor's

        try:
            loaded = model.load_weights(_on(device, dtype, tracked(), quant))
        except ValueError as e:
            if quant is None or not current[0] or current[0] in str(e):
                raise  # checked above, past the tensors, or naming the tensor already
            raise ValueError(
                f"{source.path}: tensor {current[0]!r} does not fit the model its config "
                f"describes ({quant.describe()}): {e}"
            ) from e
        check_loaded(model, loaded, source.path)
    if quant is not None:
        quant.process_weights_after_loading(model)
    return model.to(device).eval()  # moves the buffers built on the CPU (rotary tables)


def build_on_meta(
    model_config: ModelConfig, device: torch.device, attn_backend_cls: type[AttentionBackend]
) -> tuple[nn.Module, QuantizationConfig | None]:
    """The model on `meta` in its dtype (this process's tensor-parallel shard), its Linears
    given their quantization methods: what `load_model` fills, and what `pagellm plan`
    counts the bytes of."""
    dtype = model_config.dtype
    model_cls = get_model_cls(model_config.architecture, model_config.runner)
    checkpoint = None  # quantization="gguf" picks its layers by the file's tensor types
    if model_config.quantization == "gguf":
        checkpoint = gguf_tensors(read_gguf(model_config.source.path))
    quant = get_quant_config(model_config, device, checkpoint)
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(model_config.hf_config, attn_backend_cls)
        if quant is not None:
            count = quant.attach(model)
            moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
            experts = sum(m.quant_method is not None for m in moe)
            kind = str(dtype).removeprefix("torch.")
            kept = f"; {len(moe)} MoE layers: {experts} with quantized experts, routers in {kind}"
            logger.info("quantization: %s, %d linear layers%s", quant.describe(), count - experts,
                        kept if moe else "")  # fmt: skip
    return model, quant


def check_checkpoint(model: nn.Module, source: ModelSource) -> None:
    """Run the model's own `load_weights` on `meta` tensors of the checkpoint's shapes: an
    unknown name, a wrong shape or a parameter without a tensor raises a ValueError naming
    the file and the tensor. Nothing is read but headers; the parameters stay on `meta`."""
    current = ["", ""]  # the file and tensor being checked

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for path, name, tensor in _shapes(source):
            current[:] = [os.path.basename(path), name]
            yield name, tensor

    try:
        loaded = model.load_weights(tracked())
    except (ValueError, RuntimeError) as e:
        path, name = current
        raise ValueError(
            f"{path}: tensor {name!r} does not fit the model its config describes: {e}"
        ) from e
    check_loaded(model, loaded, source.path)


def _shapes(source: ModelSource) -> Iterator[tuple[str, str, torch.Tensor]]:
    if source.kind == "gguf":
        for name, tensor in gguf_shapes(read_gguf(source.path)):
            yield source.path, name, tensor
    else:
        yield from checkpoint_shapes(checkpoint_files(source.path, source.load_format))


def iter_weights(
    source: ModelSource, quant: QuantizationConfig | None = None
) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor or safetensors slice) pairs of a gguf or hf source."""
    if source.kind == "gguf":
        return gguf_weights(read_gguf(source.path), getattr(quant, "raw_names", ()))
    if source.kind == "hf":
        return hf_folder_weights(checkpoint_files(source.path, source.load_format))
    raise ValueError(f"a {source.kind!r} model source has no weights to read")


def _on(
    device: torch.device,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, Any]],
    quant: QuantizationConfig | None = None,
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Each tensor read (whole, or the part this rank holds) straight to device and dtype, or
    read whole as a quantization method prepares it (quantization runs on one rank only)."""
    for name, tensor in weights:
        kv_scale = checkpoint_kv_scale(name) is not None
        if quant is None or kv_scale:  # fp8 KV scales stay float32
            yield name, CheckpointTensor(tensor, device, torch.float32 if kv_scale else dtype)
            continue
        tensor = quant.prepare_tensor(name, CheckpointTensor(tensor).read(), dtype)
        if tensor is not None:
            yield name, CheckpointTensor(tensor, device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
