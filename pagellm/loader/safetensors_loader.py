"""Weights of an HF model folder: safetensors shards (the index's, when there is one), or
PyTorch `.bin` files when the folder has no safetensors (load_format "auto" or "pt").

`checkpoint_files` says which files hold the weights (a ValueError naming the folder when
none do); `checkpoint_shapes` reads only their headers; `hf_folder_weights` reads the tensors,
one at a time, with a progress bar over the files (rank 0's only).
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from pagellm.distributed.parallel_state import get_tp_group

_INDEXES = {"safetensors": "model.safetensors.index.json", "pt": "pytorch_model.bin.index.json"}
_PATTERNS = {"safetensors": "*.safetensors", "pt": "*.bin"}
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin")


def checkpoint_files(folder: str, load_format: str = "auto") -> list[str]:
    """Paths of the weight files: safetensors first (for "auto"), `.bin` only without them."""
    formats = ("safetensors", "pt") if load_format == "auto" else (load_format,)
    for fmt in formats:
        files = _files_of(folder, fmt)
        if files:
            return files
    wanted = " or ".join(_PATTERNS[f] for f in formats)
    raise ValueError(f"model folder {os.path.abspath(folder)} has no weights ({wanted} files)")


def _files_of(folder: str, fmt: str) -> list[str]:
    index = os.path.join(folder, _INDEXES[fmt])
    if os.path.isfile(index):  # a sharded checkpoint: only the shards it names
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise ValueError(f"{index} names shards that are not in the folder: {missing[:3]}")
        return [os.path.join(folder, n) for n in names]
    files = sorted(glob.glob(os.path.join(glob.escape(folder), _PATTERNS[fmt])))
    return [f for f in files if os.path.basename(f) not in _NOT_WEIGHTS]


def checkpoint_shapes(files: list[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, HF name, a `meta` tensor of the stored shape): headers only, no data read."""
    for path in files:
        for name, tensor in _read(path, meta=True):
            yield path, name, tensor


def hf_folder_weights(files: list[str]) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs in file order. From safetensors a tensor is a slice: nothing is
    read until the consumer indexes it (a whole tensor, or one rank's rows or columns)."""
    quiet = get_tp_group().rank != 0  # one bar: rank 0's
    bar = tqdm(
        files, desc="Loading checkpoint shards", unit="file", dynamic_ncols=True, disable=quiet
    )
    for path in bar:
        yield from _read(path, meta=False)


def _read(path: str, meta: bool) -> Iterator[tuple[str, Any]]:
    if path.endswith(".safetensors"):
        yield from _read_safetensors(path, meta)
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for name, tensor in state.items():
        yield name, tensor.to("meta") if meta else tensor


def _read_safetensors(path: str, meta: bool) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            part = f.get_slice(name)
            yield name, torch.empty(part.get_shape(), device="meta") if meta else part


def checkpoint_dtype_bytes(files: list[str]) -> dict[str, int]:
    """Bytes of a checkpoint's tensors by stored dtype ("BF16", "F8_E4M3", ...), from the
    safetensors headers alone (`pagellm plan`); {} for `.bin` files (no header to read)."""
    totals: dict[str, int] = {}
    for path in files:
        if not path.endswith(".safetensors"):
            return {}
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                totals[entry["dtype"]] = totals.get(entry["dtype"], 0) + end - start
    return totals
