"""InputBatch: the model runner's persistent per-request state, in numpy rows.

Each request the runner holds owns one row of fixed-size arrays (token ids, block table,
sampling settings) from the step it arrives until it finishes or is preempted. A step
then builds its flat batch with a few vectorized gathers over the scheduled rows: no
per-token Python.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.core.sched_output import NewRequestData
from pagellm.sample.logits_processor import (
    LogitsProcessor,
    NewRow,
    SamplingStep,
    build_logits_processors,
)
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.utils import to_device

# per-request sampling settings held in one numpy row each; the logits processors keep theirs
_SAMPLING_ROWS = ("temperature", "top_k", "top_p", "min_p")


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str = "cpu",
        vocab_size: int | None = None,  # needed once a request has a penalty
        processors: list[type[LogitsProcessor]] | None = None,  # default: the registry's
    ) -> None:
        self.max_model_len = max_model_len
        self.device = torch.device(device)  # where seeded generators draw
        max_blocks = -(-max_model_len // block_size)
        # one extra column: a request may sample at position max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # added to a request's positions where the rotary table has rows for it apart: a
        # longrope model's long factors (ModelRunner.long_rope_rows)
        self.rope_offset = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        # penalties, logit_bias, bad_words, min_tokens, allowed ids, grammar masks
        self.processors = build_logits_processors(max_num_reqs, vocab_size, self.device, processors)
        self.prompt_logprob_rows: set[int] = set()  # rows whose requests want prompt logprobs
        self._logprob_rows: set[int] = set()  # rows that want logprobs of sampled tokens
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add_request(self, new: NewRequestData, rope_offset: int = 0) -> int:
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.rope_offset[row] = rope_offset
        self.num_blocks[row] = 0
        self.append_block_ids(row, new.block_ids)
        self._set_sampling(row, new.sampling_params)
        req = NewRow(
            new.sampling_params, new.prompt_token_ids, new.output_token_ids, new.eos_token_ids
        )
        for proc in self.processors:
            proc.add_request(row, req)
        return row

    def logits_processor(self, cls: type[LogitsProcessor]) -> LogitsProcessor:
        return next(proc for proc in self.processors if type(proc) is cls)

    def _set_sampling(self, row: int, params: SamplingParams) -> None:
        self.params[row] = params
        for name in _SAMPLING_ROWS:
            getattr(self, name)[row] = getattr(params, name)
        if params.prompt_logprobs is not None:
            self.prompt_logprob_rows.add(row)
        if params.logprobs is not None:
            self._logprob_rows.add(row)
        if params.seed is not None:
            self.generators[row] = torch.Generator(self.device).manual_seed(params.seed)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.generators.pop(row, None)
        self.prompt_logprob_rows.discard(row)
        self._logprob_rows.discard(row)
        for proc in self.processors:
            proc.remove_request(row)
        self._free_rows.append(row)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def sampling_metadata(
        self,
        rows: np.ndarray,
        device: torch.device,
        req_ids: list[str] | None = None,
        grammar: GrammarBitmask | None = None,
        drafts_before: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """The step's settings for `rows` [S] (its requests `req_ids`, masked by `grammar`;
        `drafts_before` [S] in a verify step: the drafts before each row's position)."""
        temperature = self.temperature[rows]
        greedy = temperature < 1e-5
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        return SamplingMetadata(
            temperature=to_device(temperature, device),
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            top_k=_optional(top_k, top_k > 0, device),
            top_p=_optional(top_p, top_p < 1.0, device),
            min_p=_optional(min_p, min_p > 0.0, device),
            generators=(
                {i: self.generators[r] for i, r in enumerate(rows) if r in self.generators}
                if self.generators
                else {}
            ),
            max_num_logprobs=self._max_num_logprobs(rows),
            processors=self._processors(
                SamplingStep(
                    rows,
                    self.token_ids,
                    self.num_tokens,
                    self.num_prompt_tokens,
                    device,
                    req_ids,
                    grammar,
                    drafts_before,
                )  # fmt: skip
            ),
        )

    def _processors(self, step: SamplingStep) -> list[tuple[LogitsProcessor, object]]:
        """The logits processors with work this step and their arguments (most steps: none)."""
        active = []
        for proc in self.processors:
            args = proc.prepare(step)
            if args is not None:
                active.append((proc, args))
        return active

    def _max_num_logprobs(self, rows: np.ndarray) -> int | None:
        if not self._logprob_rows:
            return None
        ks = [self.params[r].logprobs for r in rows.tolist() if r in self._logprob_rows]
        return max(ks) if ks else None


def _optional(values: np.ndarray, used: np.ndarray, device: torch.device) -> torch.Tensor | None:
    return to_device(values, device) if used.any() else None
