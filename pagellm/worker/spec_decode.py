"""The model runner's side of speculative decoding: drafts into the step's rows, their
verification after the forward, and the next drafts once the tokens are back.

The scheduler sends each drafted request's drafts with the step (`scheduled_spec_decode_tokens`)
and schedules 1 + k tokens for it: its last token and the k drafts, written into its row
after its tokens (not counted in them). The forward computes all of them as it computes a
prefill chunk; the logits of the last 1 + k positions go to the rejection sampler
(`pagellm/sample/rejection_sampler.py`), which returns the accepted drafts and one token
more. Once those are on the host the proposer drafts again for every request that sampled,
as many drafts as `AdaptiveDrafts` gives it. The logits processors see each verify row
at its position (the drafts before it: `SamplingStep.drafts_before`), so penalties, bad
words, min_tokens, a thinking budget and a grammar's masks hold at every position.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagellm.config import SpeculativeConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import broadcast_from_rank0, get_tp_group
from pagellm.sample.rejection_sampler import VerifyLayout, position_generators, verify
from pagellm.spec_decode.adaptive import AdaptiveDrafts, StepCosts
from pagellm.spec_decode.proposer import Drafting, NgramProposer, Proposer, SuffixTreeProposer
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.utils import to_device
from pagellm.worker.async_output import AsyncModelRunnerOutput, SampledTokens
from pagellm.worker.logprobs import attach_logprobs, prompt_logprobs
from pagellm.worker.step_batch import StepBatch

if TYPE_CHECKING:
    from pagellm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def make_proposer(config: SpeculativeConfig, runner: Any) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixTreeProposer(config)
    if config.method in ("draft_model", "eagle3", "mtp"):
        from pagellm.spec_decode.draft_model import DraftModelProposer
        from pagellm.spec_decode.eagle3 import Eagle3Proposer
        from pagellm.spec_decode.mtp import MtpProposer
        from pagellm.worker.draft_host import DraftHost

        classes = {"draft_model": DraftModelProposer, "eagle3": Eagle3Proposer}
        cls = classes.get(config.method, MtpProposer)
        return cls(config, runner.config.draft_model_config, DraftHost(runner))
    raise ValueError(f"speculative method {config.method!r} is not served yet")


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        self.config = config
        self.runner = runner
        self.proposer = make_proposer(config, runner)
        self.adaptive = AdaptiveDrafts(config.num_speculative_tokens, enabled=config.adaptive)
        # measured where a step's period is its cost: the CPU (eager, synchronous). On a GPU
        # under async scheduling the periods of plain steps came out a fifth of drafted ones'
        # where drafting was 1.6x faster (H100, 2026-12-06): the defaults stay there
        self.costs = (
            StepCosts(config.num_speculative_tokens, self.adaptive.draft_cost)
            if runner.device.type == "cpu"
            else None
        )
        self.last_step: tuple[float, int, int] | None = None  # (start, requests, drafts)
        self.logged_costs = (0.0, self.adaptive.draft_cost)
        max_reqs = runner.input_batch.num_tokens.shape[0]
        self.num_drafts = np.zeros(max_reqs, np.int64)  # drafts in each row this step
        self.drafted_rows: list[int] = []
        self.is_rank0 = get_tp_group().rank == 0

    def remove_request(self, req_id: str) -> None:
        self.adaptive.remove(req_id)
        self.proposer.remove_request(req_id)

    def add_drafts(self, ib: InputBatch, sched: SchedulerOutput) -> None:
        """Write the step's drafts after their requests' tokens (not counted in them)."""
        self.num_drafts[self.drafted_rows] = 0
        self.drafted_rows = []
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            row = ib.req_id_to_row[req_id]
            n = int(ib.num_tokens[row])
            ib.token_ids[row, n : n + len(drafts)] = drafts
            self.num_drafts[row] = len(drafts)
            self.drafted_rows.append(row)

    def as_decode_rows(self, batch: StepBatch) -> StepBatch:
        """The step's forward batch: with drafts and no row longer than 1 + k, each token a
        row of its own (its request's block table, the keys up to it), so a verify step is a
        decode-only step (CUDA graphs, the decode kernels: each position rounded as
        decoding it alone would). Its tokens, hence the hidden states, keep their order. At
        most max_num_seqs rows (the step buffers' and the graphs' size)."""
        max_rows = self.config.num_speculative_tokens + 1
        too_many = len(batch.positions) > self.runner.config.scheduler_config.max_num_seqs
        if not self.drafted_rows or too_many or int(batch.num_scheduled.max()) > max_rows:
            return batch
        rows = np.repeat(batch.rows, batch.num_scheduled)
        forward = StepBatch(batch.req_ids, rows, np.ones(len(rows), np.int64))
        forward.positions = batch.positions
        forward.seq_lens = (batch.positions + 1).astype(np.int32)
        return forward

    def step_started(self, batch: StepBatch) -> None:
        """A step starts: the one before it (if a decode step) took until now, which is its
        cost in the drafts' measure (`StepCosts`)."""
        if self.costs is None:
            return
        now = time.perf_counter()
        if self.last_step is not None:
            start, num_reqs, num_drafts = self.last_step
            self.costs.record(num_reqs, num_drafts, now - start)
            fitted = (self.costs.step_cost, self.costs.draft_cost)
            if max(abs(a - b) for a, b in zip(fitted, self.logged_costs)) > 0.2:
                logger.info(
                    "speculative decoding: a step with k drafts a request costs 1 + %.2f + "
                    "%.2f k steps without (measured)",
                    *fitted,
                )
                self.logged_costs = fitted
            self.adaptive.step_cost, self.adaptive.draft_cost = fitted
        num_drafts = int(self.num_drafts[batch.rows].sum()) if self.drafted_rows else 0
        decode = int(batch.num_scheduled.sum()) == len(batch.rows) + num_drafts
        self.last_step = (now, len(batch.rows), num_drafts) if decode else None

    # ---- verification --------------------------------------------------------------------

    def verifies(self, batch: StepBatch) -> bool:
        """Whether the step samples through the verifier: it has drafts, or a seeded request
        (whose every token is drawn by its position: the same output, drafts or not)."""
        ib = self.runner.input_batch
        return bool(self.drafted_rows) or any(r in ib.generators for r in batch.rows.tolist())

    def sample(
        self, batch: StepBatch, hidden: torch.Tensor, grammar: GrammarBitmask | None
    ) -> AsyncModelRunnerOutput:
        """The step's sampling through the rejection sampler: each sampling request's last
        1 + k rows (k drafts, maybe none)."""
        runner, ib = self.runner, self.runner.input_batch
        device = runner.device
        k = self.num_drafts[batch.rows]
        sample_idx = np.flatnonzero(batch.seq_lens == ib.num_tokens[batch.rows] + k)
        output = ModelRunnerOutput(batch.req_ids, [[] for _ in batch.req_ids])
        if ib.prompt_logprob_rows:
            output.prompt_logprobs = prompt_logprobs(runner.model, ib, batch, hidden, device)
        if len(sample_idx) == 0:
            return AsyncModelRunnerOutput(output)
        ks, rows = k[sample_idx], batch.rows[sample_idx]
        layout = VerifyLayout(ks)
        within = np.arange(layout.num_rows) - np.repeat(layout.starts, ks + 1)  # j per row
        ends = batch.query_start_loc[1:][sample_idx].astype(np.int64)
        index = np.repeat(ends - ks - 1, ks + 1) + within  # hidden rows of the last 1 + k
        logits = runner.model.compute_logits(hidden[to_device(index, device)])
        flat_rows = np.repeat(rows, ks + 1)
        req_ids = [batch.req_ids[i] for i in np.repeat(sample_idx, ks + 1).tolist()]
        drafts_before = within if self.drafted_rows else None
        meta = ib.sampling_metadata(flat_rows, device, req_ids, grammar, drafts_before)
        if meta.generators:  # seeded: each token drawn by its position's generator
            seeds = {i: ib.params[flat_rows[i]].seed for i in meta.generators}
            meta.generators = position_generators(seeds, ib.num_tokens[flat_rows] + within, device)
        draft_ids = ib.token_ids[flat_rows, ib.num_tokens[flat_rows] + within]
        draft_ids[within == np.repeat(ks, ks + 1)] = -1  # a request's last row: no draft
        tokens, result = verify(logits, meta, to_device(draft_ids, device), layout)
        if meta.processors:  # the tokens kept, in the flat rows' order (-1: a row not kept)
            kept = to_device(np.flatnonzero(layout.valid.ravel()), device)  # no device sync
            meta.record(tokens.reshape(-1)[kept])
        if get_tp_group().size > 1:
            broadcast_from_rank0(tokens)  # every rank appends the same tokens
        result.sampled = tokens  # [S, K + 1]: what the host reads back; logprobs per row
        req_ids = [batch.req_ids[i] for i in sample_idx.tolist()]
        positions = ib.num_tokens[rows]
        sampled = SampledTokens(sample_idx, rows, req_ids, positions, result, device)
        ib.num_tokens[rows] += 1  # the rest once the tokens are back
        runner.pending.record(sampled)  # a request without drafts may run on before that
        return AsyncModelRunnerOutput(output, sampled, self._read_back(layout, ks))

    def _read_back(self, layout: VerifyLayout, ks: np.ndarray):
        def read_back(output: ModelRunnerOutput, sampled: SampledTokens) -> None:
            tokens = sampled.wait()  # [S, K + 1], -1 beyond each request's tokens
            counts = (tokens >= 0).sum(axis=1)
            ib = self.runner.input_batch
            held = []
            for j, i in enumerate(sampled.sample_idx.tolist()):
                new = tokens[j, : counts[j]]
                output.sampled_token_ids[i] = new.tolist()
                row, req_id = int(sampled.rows[j]), sampled.req_ids[j]
                if ks[j]:
                    self.adaptive.observe(req_id, int(ks[j]), int(counts[j]) - 1)
                if ib.req_id_to_row.get(req_id) == row:
                    pos = int(sampled.positions[j])
                    ib.token_ids[row, pos : pos + len(new)] = new
                    ib.num_tokens[row] += len(new) - 1
                    held.append((req_id, row, pos + len(new)))
            if sampled.result.logprobs is not None:
                groups = list(zip(layout.starts.tolist(), counts.tolist()))
                attach_logprobs(output, sampled.sample_idx, sampled.result, groups)
            self.runner.pending.read_back(sampled)
            output.spec_token_ids = self.propose(held)

        return read_back

    # ---- proposals -----------------------------------------------------------------------

    def propose(self, held: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        """Drafts after the known tokens of each (request, row, tokens known) that just
        sampled (rank 0's are the ones the scheduler uses). Under async scheduling a row's
        next token may already be in flight: the scheduler drops those drafts, and their
        coming tells the EngineCore to wait for each step before scheduling the next."""
        if not self.is_rank0:
            return {}
        ib = self.runner.input_batch
        wanted = []
        for req_id, row, n in held:
            k = self.adaptive.num_drafts(req_id)
            if k > 0:
                tokens = ib.token_ids[row, :n]
                wanted.append(Drafting(req_id, row, tokens, int(ib.num_prompt_tokens[row]), k))
        drafts = self.proposer.propose(wanted)  # called without any: a head still catches up
        return {r.req_id: d for r, d in zip(wanted, drafts) if d}
