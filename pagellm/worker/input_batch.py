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
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.penalties import PenaltyParams, PenaltyState
from pagellm.sampling_params import SamplingParams
from pagellm.utils import to_device

# per-request sampling settings held in one numpy row each (the arrays' dtypes are the limits)
_SAMPLING_ROWS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str = "cpu",
        vocab_size: int | None = None,  # needed once a request has a penalty
    ) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
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
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.penalties: PenaltyState | None = None  # device state, made for the first penalty
        self._token_field_rows: set[int] = set()  # rows with logit_bias or allowed_token_ids
        self.prompt_logprob_rows: set[int] = set()  # rows whose requests want prompt logprobs
        self._min_tokens_rows: set[int] = set()  # rows with min_tokens (EOS / stop ids banned)
        self._logprob_rows: set[int] = set()  # rows that want logprobs of sampled tokens
        self._bad_words_rows: set[int] = set()  # rows with bad_words
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.eos_token_ids: list[tuple[int, ...]] = [()] * max_num_reqs
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
        self._set_sampling(row, new.sampling_params, new.eos_token_ids)
        if new.sampling_params.has_penalties:
            self.penalty_state().add_request(row, new.prompt_token_ids, new.output_token_ids)
        return row

    def check_request(self, params: SamplingParams) -> None:
        """Raises what `add_request` would for these settings, so that a request the rows
        cannot hold fails alone when it is added, not the step that would schedule it."""
        for name in _SAMPLING_ROWS:
            np.asarray(getattr(params, name), dtype=getattr(self, name).dtype)
        if params.seed is not None:
            torch.Generator(self.device).manual_seed(params.seed)

    def penalty_state(self) -> PenaltyState:
        if self.penalties is None:
            if self.vocab_size is None:
                raise ValueError("penalties need the vocabulary size (InputBatch vocab_size)")
            self.penalties = PenaltyState(len(self.params), self.vocab_size, self.device)
        return self.penalties

    def _set_sampling(
        self, row: int, params: SamplingParams, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.params[row] = params
        self.eos_token_ids[row] = eos_token_ids
        for name in _SAMPLING_ROWS:
            getattr(self, name)[row] = getattr(params, name)
        if params.logit_bias or params.allowed_token_ids:
            self._token_field_rows.add(row)
        if params.prompt_logprobs is not None:
            self.prompt_logprob_rows.add(row)
        if params.min_tokens:
            self._min_tokens_rows.add(row)
        if params.logprobs is not None:
            self._logprob_rows.add(row)
        if params.bad_words_token_ids:
            self._bad_words_rows.add(row)
        if params.seed is not None:
            self.generators[row] = torch.Generator(self.device).manual_seed(params.seed)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.generators.pop(row, None)
        self._token_field_rows.discard(row)
        self.prompt_logprob_rows.discard(row)
        self._min_tokens_rows.discard(row)
        self._logprob_rows.discard(row)
        self._bad_words_rows.discard(row)
        self._free_rows.append(row)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def sampling_metadata(self, rows: np.ndarray, device: torch.device) -> SamplingMetadata:
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
            banned_tokens=self._banned_tokens(rows),
            **self._token_fields(rows),
            max_num_logprobs=self._max_num_logprobs(rows),
            penalties=self._penalty_params(rows, device),
        )

    def _token_fields(self, rows: np.ndarray) -> dict[str, list]:
        """logit_bias and allowed_tokens of the rows that have them (most steps: none)."""
        fields: dict[str, list] = {"logit_bias": [], "allowed_tokens": []}
        if not self._token_field_rows:
            return fields
        for i, row in enumerate(rows.tolist()):
            if row in self._token_field_rows:
                params = self.params[row]
                if params.logit_bias:
                    bias = params.logit_bias
                    fields["logit_bias"].append((i, list(bias), list(bias.values())))
                if params.allowed_token_ids:
                    fields["allowed_tokens"].append((i, params.allowed_token_ids))
        return fields

    def _penalty_params(self, rows: np.ndarray, device: torch.device) -> PenaltyParams | None:
        if self.penalties is None:
            return None
        presence, frequency = self.presence_penalty[rows], self.frequency_penalty[rows]
        repetition = self.repetition_penalty[rows]
        used = (presence != 0) | (frequency != 0) | (repetition != 1)
        if not used.any():
            return None
        return PenaltyParams(
            state=self.penalties,
            rows=to_device(rows.astype(np.int64), device),
            presence=to_device(presence, device),
            frequency=to_device(frequency, device),
            repetition=to_device(repetition, device),
        )

    def _banned_tokens(self, rows: np.ndarray) -> list[tuple[int, list[int]]]:
        """(row, ids) banned this step: stop ids under min_tokens, bad words' last tokens."""
        banned = self._min_tokens_bans(rows) if self._min_tokens_rows else []
        if self._bad_words_rows:  # most steps: no row has either, no row is walked
            banned += self._bad_words_bans(rows)
        return banned

    def _min_tokens_bans(self, rows: np.ndarray) -> list[tuple[int, list[int]]]:
        banned: list[tuple[int, list[int]]] = []
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        for i, row in enumerate(rows):
            params = self.params[row]
            if params.min_tokens and num_outputs[i] < params.min_tokens:
                # every EOS id, also with ignore_eos (vLLM's `_all_stop_token_ids`, HF's
                # min_new_tokens), and the stop token ids
                banned.append((i, [*self.eos_token_ids[row], *params.stop_token_ids]))
        return banned

    def _bad_words_bans(self, rows: np.ndarray) -> list[tuple[int, list[int]]]:
        """A bad word's last token is banned where the output so far ends with the rest of it
        (the output's last token must be on the host: the engine waits for it)."""
        banned: list[tuple[int, list[int]]] = []
        for i, row in enumerate(rows.tolist()):
            if row not in self._bad_words_rows:
                continue
            start, end = self.num_prompt_tokens[row], self.num_tokens[row]
            ids = [
                seq[-1]
                for seq in self.params[row].bad_words_token_ids
                if len(seq) - 1 <= end - start
                and self.token_ids[row, end - len(seq) + 1 : end].tolist() == seq[:-1]
            ]
            if ids:
                banned.append((i, ids))
        return banned

    def _max_num_logprobs(self, rows: np.ndarray) -> int | None:
        if not self._logprob_rows:
            return None
        ks = [self.params[r].logprobs for r in rows.tolist() if r in self._logprob_rows]
        return max(ks) if ks else None


def _optional(values: np.ndarray, used: np.ndarray, device: torch.device) -> torch.Tensor | None:
    return to_device(values, device) if used.any() else None
