"""What a proposer with a model of its own (a draft model, `pagellm/spec_decode/draft_model.py`)
borrows from the model runner, as one narrow object: the device and attention backend, the
runner's rows (a request's tokens, and its block table: the draft's K/V of a request live at
the same block ids as the target's, in the draft's own cache tensors), the step's staging
buffers and attention metadata, and the KV cache's allocation. So the draft's forwards are
built exactly as the target's are, and the proposer (on the sampling floor) never sees the
runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagellm.worker.kv_cache import zeros_kv
from pagellm.worker.step_batch import block_table_rows, host_arrays, span_batch

if TYPE_CHECKING:
    from pagellm.worker.input_batch import InputBatch
    from pagellm.worker.model_runner import ModelRunner


class DraftHost:
    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self.target_model = runner.model  # an EAGLE-3 head reads its hidden states
        self.device: torch.device = runner.device
        self.attn_backend_cls = runner.attn_backend_cls
        self.input_batch: InputBatch = runner.input_batch
        self.block_size: int = runner.block_size
        self.max_model_len: int = runner.model_config.max_model_len
        self.vocab_size: int = runner.model_config.vocab_size  # the target's
        self.max_num_seqs: int = runner.config.scheduler_config.max_num_seqs
        # tokens one forward may take: the staging buffers' size
        self.max_num_tokens: int = runner.inputs.dev["input_ids"].shape[0]

    def zeros_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's cache, zeroed as the target's (lazily, on the CPU)."""
        return zeros_kv(shape, dtype, self.device)

    def forward(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        rows: np.ndarray,  # [R] InputBatch rows
        starts: np.ndarray,  # [R] the first position computed (those before: in the cache)
        counts: np.ndarray,  # [R] tokens from there
        input_ids: torch.Tensor | None = None,  # [T] on the device; None: the rows' tokens
        long_rope_rows: int = 0,  # a longrope draft's short rows (its long ones follow)
    ) -> torch.Tensor:
        """`model` over positions starts[i] .. starts[i] + counts[i] - 1 of each row, its K/V
        written into `kv_caches` at the rows' slots: hidden states [T, hidden]. A request the
        target rotates with longrope's long factors is rotated with the draft's (if any)."""
        ib, bs = self.input_batch, self.block_size
        batch = span_batch([], rows, starts, counts)
        arrays = host_arrays(ib, batch, bs)
        long = ib.rope_offset[np.repeat(rows, counts)] > 0
        arrays["positions"] = batch.positions + long * long_rope_rows  # the draft's table rows
        dev = self._runner._stage(arrays, block_table_rows(ib, batch, bs))
        if input_ids is not None:
            dev["input_ids"] = input_ids
        return self._runner._run_model(arrays, dev, kv_caches, model)
