"""Small helpers shared across layers of the engine."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: on CUDA through pinned memory
    and a non-blocking copy (a plain `.to(device)` synchronizes the stream, which would stall
    async scheduling until the step in flight is done)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
