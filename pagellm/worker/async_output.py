"""The model runner's side of async scheduling: sampled ids read back later, and the ids of
the step in flight fed to the next step on the device.

A step's sampled ids are copied to the host without blocking (`SampledTokens`); the
engine reads them through `AsyncModelRunnerOutput.get_output()` after queueing the next
step. That next step needs, as the input of each request that sampled, an id the host does
not have yet: `PendingTokens` remembers the newest step's sampled tensor by InputBatch row
and copies those ids into the staged input buffer on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.utils import to_device


class SampledTokens:
    """What one step sampled, on the device and (once copied back) on the host."""

    __slots__ = (
        "sample_idx", "rows", "req_ids", "positions", "result", "host", "copied", "next_ids"
    )  # fmt: skip

    def __init__(self, sample_idx, rows, req_ids, positions, result, device: torch.device):
        self.sample_idx = sample_idx  # [S] indices into the step's requests
        self.rows = rows  # [S] InputBatch rows
        self.req_ids = req_ids  # [S] who held each row when it sampled
        self.positions = positions  # [S] where each token goes in its row
        self.result = result  # SamplerOutput: .sampled [S] int64 on the device, logprobs
        # (a verify step's .sampled is [S, K + 1]: accepted drafts and the token after them;
        # a request without drafts, the one that may run on before the read-back, has its
        # token in column 0)
        sampled = result.sampled
        self.next_ids = sampled if sampled.dim() == 1 else sampled[:, 0]
        on_cuda = device.type == "cuda"
        self.host = result.sampled.to("cpu", non_blocking=on_cuda)
        self.copied = torch.cuda.Event() if on_cuda else None
        if self.copied is not None:
            self.copied.record()

    def wait(self) -> np.ndarray:
        """[S] the sampled ids on the host (the step's one host sync)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.numpy()


class PendingTokens:
    """The newest queued step's samples, by InputBatch row, until they are on the host."""

    def __init__(self, max_num_reqs: int) -> None:
        self.last: SampledTokens | None = None
        self.src = np.full(max_num_reqs, -1, np.int64)  # row -> index in last's ids, or -1

    def record(self, sampled: SampledTokens) -> None:
        self.last = sampled
        self.src[:] = -1
        self.src[sampled.rows] = np.arange(len(sampled.rows))

    def drop_row(self, row: int) -> None:
        """The row's request left: its next owner has no pending token."""
        self.src[row] = -1

    def read_back(self, sampled: SampledTokens) -> None:
        """`sampled`'s ids reached the host: if it was the newest, nothing is pending."""
        if sampled is self.last:
            self.last = None

    def patch_inputs(self, batch, num_tokens: np.ndarray, input_ids: torch.Tensor) -> None:
        """Copy, on the device, the pending ids that are this step's inputs into `input_ids`.

        batch: the StepBatch; num_tokens: InputBatch.num_tokens (placeholders counted)."""
        if self.last is None:
            return
        src = self.src[batch.rows]  # [R] index into the last step's ids, or -1
        ends = batch.query_start_loc[1:] - 1  # each request's last token in the flat batch
        # a request's last token is the pending one iff it sits where that token went
        pending = (src >= 0) & (batch.positions[ends] == num_tokens[batch.rows] - 1)
        if not pending.any():
            return
        dst = to_device(ends[pending].astype(np.int64), input_ids.device)
        idx = to_device(src[pending], input_ids.device)
        input_ids.index_copy_(0, dst, self.last.next_ids.index_select(0, idx))


class AsyncModelRunnerOutput:
    """A queued step's output; `get_output()` waits for its sampled ids (once)."""

    def __init__(
        self,
        output: ModelRunnerOutput,
        sampled: SampledTokens | None = None,
        read_back: Callable[[ModelRunnerOutput, SampledTokens], None] | None = None,
    ) -> None:
        self._output = output
        self._sampled = sampled
        self._read_back = read_back

    def get_output(self) -> ModelRunnerOutput:
        if self._sampled is not None:
            self._read_back(self._output, self._sampled)
            self._sampled = None
        return self._output
