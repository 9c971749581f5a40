"""Logprobs as the model runner hands them to the scheduler: prompt logprobs of one step's
prefill chunks, and the sampled tokens' logprobs put into a step's output."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.sample.sampler import SamplerOutput, gather_logprobs
from pagellm.utils import to_device

if TYPE_CHECKING:
    from pagellm.worker.input_batch import InputBatch

PROMPT_LOGPROBS_ROWS = 512  # prompt positions whose logits are taken at once


def prompt_logprobs(
    model: Any,  # compute_logits(hidden) -> [N, vocab]
    ib: InputBatch,
    batch: Any,  # the step's StepBatch (req_ids, rows, num_scheduled, seq_lens, query_start_loc)
    hidden: torch.Tensor,  # [T, hidden] the step's last hidden states
    device: torch.device,
) -> dict[str, tuple[int, list, list, list]]:
    """For each request that wants prompt logprobs: (p0, values, ids, ranks) over the
    positions p0 .. p computed this step whose next token p + 1 is still in the prompt; the
    row of position p holds that token's logprob, then the top k (`gather_logprobs`). The
    logits are taken PROMPT_LOGPROBS_ROWS positions at a time (a whole chunk of a 150k-token
    vocabulary would take gigabytes). Read back at once: such steps wait for the GPU."""
    chunks = {}
    for i, row in enumerate(batch.rows.tolist()):
        if row not in ib.prompt_logprob_rows:
            continue
        start = int(batch.seq_lens[i] - batch.num_scheduled[i])  # first position this step
        end = min(int(batch.seq_lens[i]), int(ib.num_prompt_tokens[row]) - 1)
        values, ids, ranks = [], [], []
        for lo in range(start, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            first = int(batch.query_start_loc[i]) + lo - start  # row of position lo
            logits = model.compute_logits(hidden[first : first + hi - lo]).float()
            targets = to_device(ib.token_ids[row, lo + 1 : hi + 1].astype(np.int64), device)
            v, t, r = gather_logprobs(logits, targets, ib.params[row].prompt_logprobs)
            values += v.tolist()
            ids += t.tolist()
            ranks += r.tolist()
        if values:
            chunks[batch.req_ids[i]] = (start, values, ids, ranks)
    return chunks


def attach_logprobs(
    output: ModelRunnerOutput,
    sample_idx: np.ndarray,
    result: SamplerOutput,
    groups: list[tuple[int, int]] | None = None,
) -> None:
    """The sampled tokens' logprobs (read back now) into `output`, by request index: row j of
    `result` is sampling request j's token, or (speculative decoding) `groups[j]` = (first
    row, tokens) of its accepted tokens."""
    values = result.logprobs.cpu().tolist()
    ids = result.logprob_ids.cpu().tolist()
    ranks = result.logprob_ranks.cpu().tolist()
    output.logprobs = [[] for _ in output.req_ids]
    output.logprob_token_ids = [[] for _ in output.req_ids]
    output.logprob_ranks = [[] for _ in output.req_ids]
    for j, i in enumerate(sample_idx.tolist()):
        start, n = groups[j] if groups is not None else (j, 1)
        output.logprobs[i] = values[start : start + n]
        output.logprob_token_ids[i] = ids[start : start + n]
        output.logprob_ranks[i] = ranks[start : start + n]
