"""What `pagellm plan` learns of a model without loading or downloading its weights.

The config comes from where the engine would read it: a local HF folder's config.json, a
GGUF file's header, a shipped config (`pagellm/model_configs`), or a Hub id's config.json
alone (nothing else is fetched; offline, the Hugging Face cache). The model is then built on
`meta` as the loader builds it (`build_on_meta`: this rank's shard, the quantization
methods attached), and its weights are counted as the loader will hold them
(`loaded_weight_bytes`); the checkpoint's own bytes come from the safetensors headers or the
GGUF tensor directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.config import ModelConfig, ModelSource
from pagellm.distributed.parallel_state import building_rank
from pagellm.engine.arg_utils import EngineArgs, check_heads
from pagellm.kv_cache_dtype import kv_cache_torch_dtype
from pagellm.kv_cache_size import kv_block_bytes, kv_bytes_per_token
from pagellm.layers.linear import heads_per_rank
from pagellm.layers.rope import max_positions
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.hub import download_config
from pagellm.loader.model_loader import build_on_meta
from pagellm.loader.safetensors_loader import checkpoint_dtype_bytes, checkpoint_files
from pagellm.loader.source import (
    is_hub_id,
    resolve_model_source,
    shipped_config_dir,
)
from pagellm.models.registry import get_model_cls, kv_sliding_window
from pagellm.quantization.base import loaded_weight_bytes


@dataclass(frozen=True)
class ModelFacts:
    """One rank's share of a model, as the engine would load it."""

    config: ModelConfig
    tensor_parallel_size: int
    weight_bytes: int  # as loaded: quantized Linears as their methods hold them
    buffer_bytes: int  # rotary tables and other buffers (on the device too)
    checkpoint_bytes: dict[str, int]  # the files' tensors by stored dtype ({}: none read)
    num_kv_heads: int  # this rank's (replicated when fewer than ranks)
    kv_dtype: torch.dtype
    windowed_layers: int  # layers with a sliding window
    kv_window: int | None  # every layer windowed: the largest window (the scheduler's)

    @property
    def max_positions(self) -> int:
        """The model's own length limit (max_position_embeddings, rope-scaled)."""
        return max_positions(self.config.hf_config)

    @property
    def kv_bytes_per_token(self) -> int:
        mc = self.config
        return kv_bytes_per_token(
            mc.num_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype.itemsize, mc.kv_parts
        )

    def kv_block_bytes(self, block_size: int) -> int:
        mc = self.config
        return kv_block_bytes(
            mc.num_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype.itemsize, block_size,
            mc.kv_parts,
        )  # fmt: skip


def read_model(args: EngineArgs, device: torch.device) -> ModelFacts:
    """The facts of `args.model` on `device` with `args`' dtype, quantization, KV cache
    dtype and tensor-parallel size (ValueError where the engine would refuse them)."""
    source = plan_source(args)
    mc = args.create_model_config(device, source)
    tp = args.tensor_parallel_size
    check_heads(mc.hf_config, tp)
    with building_rank(0, tp):
        model, _ = build_on_meta(mc, device, TorchAttentionBackend)
        _, kv_heads = heads_per_rank(mc.hf_config.num_attention_heads, mc.num_kv_heads)
    windows = list(get_model_cls(mc.architecture).sliding_windows(mc.hf_config))
    return ModelFacts(
        config=mc,
        tensor_parallel_size=tp,
        weight_bytes=loaded_weight_bytes(model),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        checkpoint_bytes=_checkpoint_bytes(source),
        num_kv_heads=kv_heads,
        kv_dtype=kv_cache_torch_dtype(args.kv_cache_dtype, mc.dtype),
        windowed_layers=sum(w is not None for w in windows),
        kv_window=kv_sliding_window(mc.architecture, mc.hf_config),
    )


def plan_source(args: EngineArgs) -> ModelSource:
    """Where the model's config is, weights never fetched: a local folder (its weight files'
    headers are read if it has them), a GGUF file, the embedded default, a shipped config
    (also for its Hub ids), or a Hub id's config.json."""
    model = args.model
    path = os.path.expanduser(model) if model else ""
    if model is None or path.endswith(".gguf"):
        return resolve_model_source(model, _without_dummy(args.load_format))
    if os.path.isdir(path):
        fmt = args.load_format if _has_weights(path, args.load_format) else "dummy"
        return resolve_model_source(model, fmt)
    shipped = shipped_config_dir(model)
    if shipped is not None:
        return ModelSource(model, "dummy", str(shipped))
    if not is_hub_id(model):
        return resolve_model_source(model, "dummy")  # its error names what was tried
    try:
        folder = download_config(model, args.revision, args.download_dir)
    except ValueError as e:
        raise ValueError(
            f"{e}. pagellm plan reads only config.json of a Hub model: with no Hub reachable, "
            "pass a local folder, a .gguf file or a shipped config name"
        ) from e
    return ModelSource(model, "dummy", folder)


def _without_dummy(load_format: str) -> str:
    return "auto" if load_format == "dummy" else load_format


def _has_weights(folder: str, load_format: str) -> bool:
    try:
        checkpoint_files(folder, _without_dummy(load_format))
    except ValueError:
        return False
    return True


def _checkpoint_bytes(source: ModelSource) -> dict[str, int]:
    """The stored tensors' bytes by dtype: safetensors headers, or the GGUF directory."""
    if source.path.endswith(".gguf"):
        totals: dict[str, int] = {}
        for tensor in read_gguf(source.path).tensors.values():
            name = tensor.qtype.name
            totals[name] = totals.get(name, 0) + tensor.data.nbytes
        return totals
    if source.kind != "hf":
        return {}
    return checkpoint_dtype_bytes(checkpoint_files(source.path, source.load_format))
