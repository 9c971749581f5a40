"""Logits processors (`pagellm/sample/logits_processor/`): each one's rows added and removed,
applied to a small logits batch against a plain-torch expectation; the order the Sampler
applies them in; and a new processor plugged in by its own class and one registration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.core.sched_output import NewRequestData
from pagellm.sample.logits_processor import PROCESSORS, build_logits_processors
from pagellm.sample.logits_processor.allowed_token_ids import AllowedTokenIds
from pagellm.sample.logits_processor.bad_words import BadWords
from pagellm.sample.logits_processor.grammar import GrammarMask
from pagellm.sample.logits_processor.interface import (
    LogitsProcessor,
    NewRow,
    SamplingStep,
    ban,
)
from pagellm.sample.logits_processor.logit_bias import LogitBias
from pagellm.sample.logits_processor.min_tokens import MinTokens
from pagellm.sample.logits_processor.penalties import Penalties
from pagellm.sample.logits_processor.thinking_budget import ThinkingBudget
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
VOCAB = 8
NEG_INF = float("-inf")


def _logits(rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3


class _Tokens:
    """Rows of prompt + output ids, as an InputBatch holds them."""

    def __init__(self, rows: dict[int, tuple[list[int], list[int]]], max_reqs: int = 4) -> None:
        self.token_ids = np.zeros((max_reqs, 16), np.int64)
        self.num_tokens = np.zeros(max_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_reqs, np.int64)
        for row, (prompt, output) in rows.items():
            ids = prompt + output
            self.token_ids[row, : len(ids)] = ids
            self.num_tokens[row], self.num_prompt_tokens[row] = len(ids), len(prompt)

    def step(self, rows: list[int], **kw) -> SamplingStep:
        return SamplingStep(
            np.asarray(rows), self.token_ids, self.num_tokens, self.num_prompt_tokens, CPU, **kw
        )


def _add(proc: LogitsProcessor, row: int, prompt=(1, 2), output=(), eos=(7,), **params) -> None:
    proc.add_request(row, NewRow(SamplingParams(**params), list(prompt), list(output), eos))


def _only(row: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.where(torch.isin(torch.arange(VOCAB), torch.tensor(ids)), row, NEG_INF)


def _apply(proc: LogitsProcessor, logits: torch.Tensor, step: SamplingStep) -> torch.Tensor:
    args = proc.prepare(step)
    return logits if args is None else proc.apply(logits.clone(), args)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    proc = MinTokens(4, VOCAB, CPU)
    _add(proc, 0, output=[3], min_tokens=2, stop_token_ids=[5], max_tokens=8)  # 1 output so far
    _add(proc, 2, output=[3, 4], min_tokens=2, max_tokens=8)  # reached
    _add(proc, 3, min_tokens=3, max_tokens=8)
    proc.remove_request(3)
    tokens = _Tokens({0: ([1, 2], [3]), 2: ([1], [3, 4]), 3: ([1], [])})
    logits = _logits()
    out = _apply(proc, logits, tokens.step([2, 0, 3]))
    expected = logits.clone()
    expected[1, [7, 5]] = NEG_INF  # logits row 1 is row 0: EOS and its stop id
    assert torch.equal(out, expected)
    assert proc.prepare(tokens.step([2, 3])) is None  # nobody under min_tokens: no work


def test_bad_words_ban_the_last_token_after_the_rest():
    proc = BadWords(4, VOCAB, CPU)
    _add(proc, 1, bad_words_token_ids=[[4], [2, 6], [3, 2, 5]])
    _add(proc, 0)  # none
    tokens = _Tokens({1: ([3], [2]), 0: ([1], [])})
    logits = _logits(2)
    out = _apply(proc, logits, tokens.step([0, 1]))
    expected = logits.clone()
    expected[1, [4, 6]] = NEG_INF  # [4] always; [2, 6] after a 2; [3, 2, 5]: 3 is the prompt's
    assert torch.equal(out, expected)
    proc.remove_request(1)
    assert proc.prepare(tokens.step([0, 1])) is None


def test_allowed_token_ids_keep_only_those():
    proc = AllowedTokenIds(4, VOCAB, CPU)
    _add(proc, 3, allowed_token_ids=[1, 6])
    _add(proc, 0)
    logits = _logits(2)
    out = _apply(proc, logits, _Tokens({}).step([3, 0]))
    expected = logits.clone()
    expected[0] = _only(logits[0], [1, 6])
    assert torch.equal(out, expected)


def test_logit_bias_adds_to_those_ids():
    proc = LogitBias(4, VOCAB, CPU)
    _add(proc, 2, logit_bias={0: 1.5, 5: -100.0})
    _add(proc, 1, logit_bias={0: 1.5})
    proc.remove_request(1)
    logits = _logits(2)
    out = _apply(proc, logits, _Tokens({}).step([1, 2]))
    expected = logits.clone()
    expected[1, 0] += 1.5
    expected[1, 5] += -100.0
    assert torch.equal(out, expected)


def test_penalties_against_plain_torch():
    proc = Penalties(4, VOCAB, CPU)
    _add(proc, 0, prompt=[1, 2], output=[3, 3], repetition_penalty=2.0, frequency_penalty=0.5)
    _add(proc, 1)  # neutral, in a step with penalties
    _add(proc, 2, prompt=[4], presence_penalty=1.0)
    assert proc.prepare(_Tokens({}).step([1])) is None  # no row of the step has a penalty
    logits = _logits()
    args = proc.prepare(_Tokens({}).step([0, 1, 2]))
    out = proc.apply(logits.clone(), args)
    expected = logits.clone()
    r0 = expected[0, [1, 2, 3]]
    expected[0, [1, 2, 3]] = torch.where(r0 > 0, r0 / 2.0, r0 * 2.0)
    expected[0, 3] -= 0.5 * 2
    assert torch.equal(out, expected)  # row 2: nothing in its output yet
    proc.record(args, torch.tensor([5, 0, 6]))  # what the step sampled
    out = proc.apply(logits[:1].clone(), proc.prepare(_Tokens({}).step([2])))
    expected = logits[:1].clone()
    expected[0, 6] -= 1.0
    assert torch.equal(out, expected)


def test_grammar_mask_uses_the_steps_bitmask():
    proc = GrammarMask(4, VOCAB, CPU)
    assert proc.prepare(_Tokens({}).step([0, 1])) is None
    bitmask = GrammarBitmask(["b"], np.array([[0b10010]], np.int32))  # tokens 1 and 4
    logits = _logits(2)
    out = _apply(proc, logits, _Tokens({}).step([0, 1], req_ids=["a", "b"], grammar=bitmask))
    expected = logits.clone()
    expected[1] = _only(logits[1], [1, 4])
    assert torch.equal(out, expected)


def test_thinking_budget_forces_the_end_tag_once_spent():
    proc = ThinkingBudget(4, VOCAB, CPU)
    budget = dict(thinking_token_budget=2, reasoning_tag_ids=([5], [6, 4]))
    _add(proc, 0, prompt=[1, 5], output=[3, 3], **budget)  # opened in the prompt: 2 thought
    _add(proc, 1, prompt=[1], output=[5, 3], **budget)  # opened by the output: 1 thought
    _add(proc, 2, prompt=[1, 5], output=[3, 3, 6], **budget)  # the end tag's first token in
    _add(proc, 3, prompt=[1, 5], output=[3, 6, 4], **budget)  # closed by the model
    tokens = _Tokens(
        {0: ([1, 5], [3, 3]), 1: ([1], [5, 3]), 2: ([1, 5], [3, 3, 6]), 3: ([1, 5], [3, 6, 4])}
    )
    logits = _logits(4)
    out = _apply(proc, logits, tokens.step([3, 2, 1, 0]))
    expected = logits.clone()
    expected[1] = _only(torch.zeros(VOCAB), [4])  # the tag's second token, whatever its logit
    expected[3] = _only(torch.zeros(VOCAB), [6])
    assert torch.equal(out, expected)
    proc.remove_request(0)
    proc.remove_request(2)
    assert proc.prepare(tokens.step([3, 2, 1, 0])) is None
    _add(proc, 0, prompt=[1, 5], output=[3, 3], thinking_token_budget=2)  # no tags: not used
    assert proc.rows.keys() == {1, 3}


def _new(req_id: str, output=(), **params) -> NewRequestData:
    return NewRequestData(req_id, [1, 2], list(output), SamplingParams(**params), [], 0, (7,))


def test_the_sampler_applies_them_in_order_and_logprobs_see_only_the_masks():
    batch = InputBatch(4, 32, 4, vocab_size=VOCAB)
    greedy = dict(temperature=0.0, logprobs=1, max_tokens=8)
    batch.add_request(_new("a", min_tokens=2, logit_bias={3: 50.0}, **greedy))
    batch.add_request(_new("b", allowed_token_ids=[2, 3], repetition_penalty=3.0, **greedy))
    batch.add_request(_new("c", **greedy))
    rows = np.array([0, 1, 2])
    meta = batch.sampling_metadata(rows, CPU)
    order = [type(p) for p, _ in meta.processors]
    assert order == [MinTokens, AllowedTokenIds, LogitBias, Penalties]
    logits = _logits()
    out = Sampler()(logits.clone(), meta)
    masked = logits.clone()
    masked[0, 7] = NEG_INF  # min_tokens: EOS
    adjusted = masked.clone()
    adjusted[1] = _only(masked[1], [2, 3])
    adjusted[0, 3] += 50.0
    seen = adjusted[1, [1, 2]]  # prompt [1, 2]
    adjusted[1, [1, 2]] = torch.where(seen > 0, seen / 3.0, seen * 3.0)
    assert out.sampled.tolist() == adjusted.argmax(-1).tolist()
    assert out.sampled[0] == 3
    reference = masked.log_softmax(-1).gather(-1, out.sampled.unsqueeze(1))
    assert torch.equal(out.logprobs[:, :1], reference)


def test_a_step_without_features_has_no_processor_work():
    batch = InputBatch(4, 32, 4, vocab_size=VOCAB)
    batch.add_request(_new("a", temperature=0.5, top_k=3, seed=1))
    assert batch.sampling_metadata(np.array([0]), CPU).processors == []
    batch.add_request(_new("b", presence_penalty=0.5))
    batch.remove_request("b")  # its row keeps the device state, neutral once it is gone
    assert batch.sampling_metadata(np.array([0]), CPU).processors == []


class _NoRepeat(LogitsProcessor):
    """A feature outside the registry: a request never samples its last output token again
    (for requests with a seed, say)."""

    masks = True

    def row_settings(self, req: NewRow) -> bool | None:
        return True if req.params.seed is not None else None

    def prepare(self, step: SamplingStep) -> list[tuple[int, list[int]]] | None:
        bans = []
        for i, row in enumerate(step.rows.tolist()):
            if row in self.rows and step.num_tokens[row] > step.num_prompt_tokens[row]:
                bans.append((i, [int(step.token_ids[row, step.num_tokens[row] - 1])]))
        return bans or None

    def apply(self, logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
        return ban(logits, bans)


def test_a_new_processor_plugs_in_by_its_class_and_one_registration():
    registry = [*PROCESSORS[:3], _NoRepeat, *PROCESSORS[3:]]  # a line in PROCESSORS
    batch = InputBatch(4, 32, 4, vocab_size=VOCAB, processors=registry)
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    for req_id in ("seeded", "plain"):
        params = dict(seed=3) if req_id == "seeded" else {}
        batch.add_request(_new(req_id, output=[5], temperature=0.0, **params))
    meta = batch.sampling_metadata(np.array([0, 1]), CPU)
    assert Sampler()(logits.clone(), meta).sampled.tolist() == [0, 5]
    batch.remove_request("seeded")
    assert batch.logits_processor(_NoRepeat).rows == {}


def test_masks_come_first():
    with pytest.raises(ValueError, match="mask"):
        build_logits_processors(2, VOCAB, CPU, [LogitBias, MinTokens])


@pytest.mark.parametrize(
    "cls, params",
    [
        (MinTokens, dict(min_tokens=4, stop_token_ids=[5])),
        (BadWords, dict(bad_words=["x"])),  # the ids are set below
        (Penalties, dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3)),
        (ThinkingBudget, dict(thinking_token_budget=2)),
        (LogitBias, dict(logit_bias={3: 1.5})),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_a_verify_row_is_the_step_after_the_drafts_before_it(cls, params):
    """Speculative decoding: row j of a verify step (drafts_before = j) gets what a plain
    step would after the request's output and its first j drafts, for every processor."""
    prompt, output, drafts = [1, 2], [6, 3], [4, 6, 6]
    extra = {}
    if cls is BadWords:
        extra = dict(bad_words_token_ids=[[6, 6], [4, 6, 2], [3]])
    if cls is ThinkingBudget:  # the drafts close the span: rejected, it must stay open
        extra, drafts = dict(reasoning_tag_ids=([1], [5, 0])), [5, 0, 6]

    def proc_after(out):
        proc = cls(4, VOCAB, CPU)
        req = NewRow(SamplingParams(max_tokens=16, **params), prompt, out, (7,))
        for key, value in extra.items():
            setattr(req.params, key, value)
        proc.add_request(1, req)
        return proc

    verify = proc_after(output)
    tokens = _Tokens({1: (prompt, output)})
    tokens.token_ids[1, 4:7] = drafts  # written after the row's tokens, not counted in them
    before = np.arange(len(drafts) + 1)
    step = tokens.step([1] * len(before), drafts_before=before, req_ids=["a"] * len(before))
    logits = _logits(1).repeat(len(before), 1)  # one row of logits at every position
    args = verify.prepare(step)
    got = logits if args is None else verify.apply(logits.clone(), args)
    for j in before.tolist():
        plain = _Tokens({1: (prompt, output + drafts[:j])})
        want = _apply(proc_after(output + drafts[:j]), logits[j : j + 1], plain.step([1]))
        assert torch.equal(got[j : j + 1], want), j
    if cls is not LogitBias:  # the one that does not read the tokens before a position
        assert not torch.equal(got[0], got[-1])  # the drafts made a difference
    # the drafts were rejected, row 0 gave token 0: the next step follows the output as if
    # nothing had been drafted
    if args is not None:
        verify.record(args, torch.tensor([0, -1, -1, -1]))
    after = output + [0]
    plain = _Tokens({1: (prompt, after)})
    want = _apply(proc_after(after), logits[:1], plain.step([1]))
    assert torch.equal(_apply(verify, logits[:1], plain.step([1])), want)


def test_penalties_count_only_the_kept_tokens_of_a_verify_step():
    proc = Penalties(4, VOCAB, CPU)
    _add(proc, 1, output=[3], frequency_penalty=1.0)
    args = proc.prepare(_Tokens({1: ([1, 2], [3])}).step([1, 1, 1]))
    proc.record(args, torch.tensor([4, 5, -1]))  # two kept, the third row past them
    assert proc.state.output_counts[1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
