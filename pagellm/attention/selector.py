"""Attention backend selection by device: it imports the backends, which import `base`."""

from __future__ import annotations

import torch

from pagellm.attention.base import AttentionBackend


def get_attn_backend_cls(device: torch.device | str) -> type[AttentionBackend]:
    """The torch backend on CPU; the Triton backend on CUDA (imported lazily)."""
    if torch.device(device).type == "cuda":
        try:
            from pagellm.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend
        except ImportError:
            pass
    from pagellm.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend
