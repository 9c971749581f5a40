"""The flat batch of one step on the host: which InputBatch rows run, each token's position,
and the arrays the forward reads (token ids, rotary rows, slot mapping, query starts, sequence
lengths, block-table rows); the same for the dummy requests of the profiling step.

    request r:  |<------------------ seq_len ------------------>|
                |<-- computed (in the cache) -->|<- scheduled ->|
    token t of r's chunk: position computed + t, slot block_table[r, pos // bs] * bs + pos % bs
"""

from __future__ import annotations

import numpy as np

from pagellm.core.sched_output import SchedulerOutput
from pagellm.worker.input_batch import InputBatch


class StepBatch:
    """The flat batch of one step, on the host; `rows` are InputBatch rows in batch order."""

    __slots__ = ("req_ids", "rows", "num_scheduled", "positions", "query_start_loc", "seq_lens")

    def __init__(self, req_ids: list[str], rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        self.req_ids = req_ids
        self.rows = rows  # [R] int64
        self.num_scheduled = num_scheduled  # [R] int64
        self.query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)  # [R + 1]
        np.cumsum(num_scheduled, out=self.query_start_loc[1:])
        self.positions = np.empty(0, dtype=np.int64)  # [T], set by prepare_batch
        self.seq_lens = np.empty(0, dtype=np.int32)  # [R], set by prepare_batch

    @property
    def is_decode_only(self) -> bool:
        return int(self.query_start_loc[-1]) == len(self.rows)


def prepare_batch(ib: InputBatch, sched: SchedulerOutput) -> StepBatch:
    """The step's rows in the scheduler's order, their tokens' positions and sequence lengths."""
    req_ids = list(sched.num_scheduled_tokens)
    rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
    num_scheduled = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(req_ids))
    return span_batch(req_ids, rows, ib.num_computed_tokens[rows], num_scheduled)


def span_batch(
    req_ids: list[str], rows: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> StepBatch:
    """Tokens starts[i] .. starts[i] + counts[i] - 1 of each row (those before in the cache):
    a step's, or a draft model's over the same rows (`pagellm/worker/draft_host.py`)."""
    batch = StepBatch(req_ids, rows, counts)
    # position of each token: its request's start + its index within the request
    offsets = np.arange(batch.query_start_loc[-1]) - np.repeat(batch.query_start_loc[:-1], counts)
    batch.positions = np.repeat(starts, counts) + offsets
    batch.seq_lens = (starts + counts).astype(np.int32)
    return batch


def host_arrays(ib: InputBatch, batch: StepBatch, bs: int) -> dict[str, np.ndarray]:
    """What the forward reads, as host arrays (`bs`: tokens a KV block)."""
    token_rows = np.repeat(batch.rows, batch.num_scheduled)  # [T]
    block_ids = ib.block_table[token_rows, batch.positions // bs]
    return {
        "input_ids": ib.token_ids[token_rows, batch.positions],  # [T]
        "positions": batch.positions + ib.rope_offset[token_rows],  # [T]: rotary table rows
        "slot_mapping": block_ids.astype(np.int64) * bs + batch.positions % bs,  # [T]
        "query_start_loc": batch.query_start_loc,  # [R + 1]
        "seq_lens": batch.seq_lens,  # [R]
    }


def block_table_rows(ib: InputBatch, batch: StepBatch, bs: int) -> np.ndarray:
    max_blocks = -(-int(batch.seq_lens.max()) // bs)
    return ib.block_table[batch.rows, :max_blocks]  # [R, max_blocks]


def profile_step(
    max_tokens: int, max_seqs: int, max_len: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(query_lens, seq_lens) of the largest step the scheduler can make: min(max_tokens,
    max_seqs * max_len) tokens in prompts of up to max_len, at most max_seqs requests; where
    one is left, a token of the last prompt becomes a decode with a short context (so the
    decode launch beside prefill tiles compiles now too)."""
    tokens = min(max_tokens, max_seqs * max_len)
    lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    query_lens, seq_lens = list(lens), list(lens)
    if len(lens) < max_seqs and lens[-1] > 1:
        query_lens[-1] -= 1
        seq_lens[-1] -= 1
        query_lens.append(1)
        seq_lens.append(min(block_size + 1, max_len))
    return np.array(query_lens, np.int32), np.array(seq_lens, np.int32)


def dummy_inputs(
    block_size: int, query_lens: np.ndarray, seq_lens: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A step's host arrays for dummy requests: token 0 everywhere, no cache writes, every
    block-table entry block 0."""
    n = int(query_lens.sum())
    arrays = {
        "input_ids": np.zeros(n, np.int64),
        "positions": np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]),
        "slot_mapping": np.full(n, -1, np.int64),
        "query_start_loc": np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        "seq_lens": np.asarray(seq_lens, np.int32),
    }
    block_rows = np.zeros((len(seq_lens), -(-int(seq_lens.max()) // block_size)), np.int32)
    return arrays, block_rows
