"""Weights of an HF model folder: every `*.safetensors` file, tensor by tensor."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

from safetensors import safe_open


def safetensors_weights(folder: str) -> Iterator[tuple[str, Any]]:
    """(HF name, safetensors slice) pairs in file order: nothing is read until the consumer
    indexes a slice (a whole tensor, or one rank's rows or columns), before the next pair."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(
            f"{os.path.abspath(folder)} has no *.safetensors files "
            "(PyTorch .bin checkpoints are not supported)"
        )
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
