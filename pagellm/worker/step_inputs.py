"""Persistent step inputs: one step's flat batch in buffers that live as long as the runner.

`StepInputs` holds pinned host staging (on CUDA) and device tensors. A step writes its numpy
arrays into the staging buffers and issues non-blocking copies; the model reads views of the
device buffers. Before the staging buffers are rewritten, the host waits for an event
recorded after the previous step's copies (a step where no request samples ends without a
sync). Used on every device; CUDA graphs (`cuda_graphs.py`) replay over the same buffers.

`pad_decode` pads a decode-only step to a captured graph's batch size: the padding rows are
requests of one token each: token 0 at position 0, slot -1 (nothing is written), seq_len 1,
reading key 0 of whatever valid block id their block-table row holds (block 0, the null
block, at start). Their outputs are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

_BUFFERS = {  # name -> dtype; sizes come from StepInputs
    "input_ids": torch.int64,  # [max_tokens]
    "positions": torch.int64,  # [max_tokens]
    "slot_mapping": torch.int64,  # [max_tokens], -1 = padding
    "query_start_loc": torch.int32,  # [max_reqs + 1]
    "seq_lens": torch.int32,  # [max_reqs]
    "block_ids": torch.int32,  # [max_reqs * max_blocks], a step's block-table rows, packed
}


class StepInputs:
    """Pinned host staging + persistent device tensors for one step's flat batch."""

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device
    ) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        sizes = {"query_start_loc": max_reqs + 1, "seq_lens": max_reqs}
        sizes["block_ids"] = max_reqs * max_blocks
        self.host: dict[str, torch.Tensor] = {}
        self.host_np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, dtype in _BUFFERS.items():
            n = sizes.get(name, max_tokens)
            self.host[name] = torch.zeros(n, dtype=dtype, pin_memory=self.on_cuda)
            self.host_np[name] = self.host[name].numpy()
            self.dev[name] = torch.zeros(n, dtype=dtype, device=device)
        # [max_reqs, max_blocks]: every view handed out keeps this row stride (graph-safe)
        self.block_table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if self.on_cuda else None

    def begin(self) -> None:
        """Wait until the last step's copies have read the staging buffers."""
        if self._copied is not None:
            self._copied.synchronize()

    def end(self) -> None:
        """Mark this step's copies as issued (call after the last `stage`)."""
        if self._copied is not None:
            self._copied.record()

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy `array` (flattened) to the front of buffer `name`; the device view of it."""
        n = array.size
        self.host_np[name][:n] = array.reshape(-1)
        dev = self.dev[name][:n]
        dev.copy_(self.host[name][:n], non_blocking=True)
        return dev

    def stage_block_table(self, rows: np.ndarray) -> torch.Tensor:
        """rows: [R, nb] block ids -> the view [R, nb] of the persistent table."""
        r, nb = rows.shape
        packed = self.stage("block_ids", rows)
        view = self.block_table[:r, :nb]
        view.copy_(packed.view(r, nb))
        return view


def pad_decode(arrays: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """Pad a decode-only step's host arrays from R requests to `size` one-token requests.

    arrays: input_ids, positions, slot_mapping [R]; seq_lens [R]; query_start_loc [R + 1].
    """
    r = len(arrays["seq_lens"])
    pad = size - r
    if pad == 0:
        return arrays
    out = dict(arrays)
    out["input_ids"] = np.concatenate([arrays["input_ids"], np.zeros(pad, np.int64)])
    out["positions"] = np.concatenate([arrays["positions"], np.zeros(pad, np.int64)])
    out["slot_mapping"] = np.concatenate([arrays["slot_mapping"], np.full(pad, -1, np.int64)])
    out["seq_lens"] = np.concatenate([arrays["seq_lens"], np.ones(pad, np.int32)])
    out["query_start_loc"] = np.arange(size + 1, dtype=np.int32)
    return out
