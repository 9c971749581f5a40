"""Speculative decoding's parts without a model: `speculative_config` checking, prompt lookup,
the adaptive draft count, and the rejection sampler's exactness (statistically: the tokens it
returns follow the target distribution whatever the drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.config import SpeculativeConfig
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.rejection_sampler import VerifyLayout, verify
from pagellm.spec_decode.adaptive import PROBE_EVERY, AdaptiveDrafts, StepCosts
from pagellm.spec_decode.ngram import ngram_drafts

# ---- speculative_config ------------------------------------------------------------------


def test_vllm_defaults_are_filled():
    ngram = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert only_max.num_speculative_tokens == 5
    suffix = SpeculativeConfig.of('{"method": "suffix", "suffix_decoding_max_tree_depth": 16}')
    assert suffix.num_speculative_tokens == 16
    draft = SpeculativeConfig.of({"model": "/some/draft", "num_speculative_tokens": 4})
    assert draft.method == "draft_model"
    assert SpeculativeConfig.of(None) is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}, "unknown key(s) lookup"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a"),
        ({"method": "ngram", "num_speculative_tokens": 1000}, "at most 64"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "positive integer"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 3}, "takes no 'model'"),
        ({"method": "draft_model", "model": "/d"}, "needs 'num_speculative_tokens'"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "in [0, 1]"),
        ({"num_speculative_tokens": 3}, "needs a 'method'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_a_malformed_config_is_a_clear_error(value, words):
    with pytest.raises(ValueError, match="speculative_config") as err:
        SpeculativeConfig.of(value)
    assert words in str(err.value)


# ---- prompt lookup -----------------------------------------------------------------------


def test_ngram_takes_the_longest_match_and_its_latest_occurrence():
    tokens = np.array([1, 2, 3, 9, 8, 5, 2, 3, 7, 7, 1, 2, 3])
    # 3-gram [1, 2, 3] occurs at 0: what followed it
    assert ngram_drafts(tokens, 2, 3, 4) == [9, 8, 5, 2]
    # only 2-grams allowed: [2, 3] last occurred at 6, followed by 7, 7
    assert ngram_drafts(tokens, 1, 2, 2) == [7, 7]
    assert ngram_drafts(np.array([4, 5, 6, 7]), 1, 3, 5) == []  # nothing repeats
    assert ngram_drafts(np.array([5]), 1, 3, 5) == []
    # a period-1 run drafts its continuation, overlapping the suffix itself
    assert ngram_drafts(np.array([6, 6, 6, 6]), 2, 2, 3) == [6, 6]


# ---- adaptive draft count ----------------------------------------------------------------


def test_adaptive_drafts_follow_acceptance_and_probe_when_idle():
    adaptive = AdaptiveDrafts(max_drafts=6, draft_cost=0.1)
    assert 0 < adaptive.num_drafts("a") <= 6
    for _ in range(10):  # every draft accepted: the most drafts
        adaptive.observe("a", 6, 6)
    assert adaptive.num_drafts("a") == 6
    for _ in range(20):  # every draft rejected: none, then a one-draft probe now and then
        adaptive.observe("a", 1, 0)
    counts = [adaptive.num_drafts("a") for _ in range(2 * PROBE_EVERY)]
    assert counts.count(1) == 2 and counts.count(0) == 2 * PROBE_EVERY - 2
    assert AdaptiveDrafts(4, enabled=False).num_drafts("b") == 4
    adaptive.remove("a")
    assert "a" not in adaptive.acceptance


def test_measured_step_costs_set_how_many_drafts_pay():
    """The costs fitted to the steps' periods: a plain one-request step takes 6 ms, one with
    k drafts 6 (1 + s + c k) ms. On a CPU's costs (s = 0, c = 1/3) a request at 80%
    acceptance drafts fewer tokens than on a GPU's (c = 0.1); where a drafted step costs
    twice a plain one before its rows (s = 1), drafts at 50% acceptance do not pay."""

    def fitted(s: float, c: float) -> StepCosts:
        costs = StepCosts(max_drafts=5, draft_cost=0.1)
        for step in range(StepCosts.REFIT_EVERY * 4):
            k = step % 4  # 0..3 drafts
            costs.record(1, k, 0.006 * ((1 + s + c * k) if k else 1))
        costs.record(1, 2, 5.0)  # a step that waited for work: a median ignores it
        return costs

    cpu, stalls = fitted(0.0, 1 / 3), fitted(1.0, 0.05)
    assert (cpu.step_cost, cpu.draft_cost) == (pytest.approx(0.0, abs=1e-9), pytest.approx(1 / 3))
    assert (stalls.step_cost, stalls.draft_cost) == (pytest.approx(1.0), pytest.approx(0.05))
    gpu, on_cpu, stalled = (AdaptiveDrafts(5) for _ in range(3))
    on_cpu.draft_cost = cpu.draft_cost
    stalled.step_cost, stalled.draft_cost = stalls.step_cost, stalls.draft_cost
    for adaptive in (gpu, on_cpu):
        for _ in range(10):
            adaptive.observe("a", 5, 4)
    assert 0 < on_cpu.num_drafts("a") < gpu.num_drafts("a")
    for adaptive in (gpu, stalled):
        for _ in range(10):
            adaptive.observe("b", 5, 1)  # the first draft accepted, the second not
    assert gpu.num_drafts("b") > 0 and stalled.num_drafts("b") == 0


# ---- rejection sampler -------------------------------------------------------------------


def _meta(n: int, temperature: float, generators=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        top_k=None,
        top_p=None,
        min_p=None,
        generators=generators or {},
    )


def test_greedy_accepts_drafts_up_to_the_first_argmax_they_miss():
    vocab = 6
    # request 0: 3 drafts; rows' argmax 4, 1, 5, 2 -> drafts [4, 1, 0]: 2 accepted, then 5
    # request 1: 1 draft [3], argmax 3 then 0: all accepted, then the bonus 0
    # request 2: no draft: its argmax
    argmax = [4, 1, 5, 2, 3, 0, 2]
    drafts = [4, 1, 0, -1, 3, -1, -1]
    logits = torch.full((7, vocab), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 1.0
    layout = VerifyLayout(np.array([3, 1, 0]))
    tokens, _ = verify(logits, _meta(7, 0.0), torch.tensor(drafts), layout)
    assert tokens.tolist() == [[4, 1, 5, -1], [3, 0, -1, -1], [2, -1, -1, -1]]


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's chi-square over the cells with expected count >= 5, at ~p = 1e-4."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    stat = (((counts - expected) ** 2)[keep] / expected[keep]).sum()
    dof = keep.sum() - 1
    return stat < dof + 6 * np.sqrt(2 * dof) + 10


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_random_sampling_keeps_the_target_distribution(with_draft_probs):
    """20,000 requests at once, 2 drafts each from a skewed proposal q (given as q, or as
    one-hot drafts): the first token, and the second after an accepted first, follow the
    target p, not q."""
    torch.manual_seed(0)
    vocab, n_req, k = 5, 20000, 2
    p_rows = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3]])
    q = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])  # proposes mostly what p rarely wants
    # every request: row 0 ~ p_rows[0], row 1 ~ p_rows[1] (whatever came first), row 2 = p_rows[0]
    rows = torch.stack([p_rows[0], p_rows[1], p_rows[0]]).repeat(n_req, 1)
    logits = rows.log()
    drafts = torch.multinomial(q, n_req * k, replacement=True).view(n_req, k)
    draft_ids = torch.cat([drafts, torch.full((n_req, 1), -1)], 1).flatten()
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.cat([q.repeat(n_req, k, 1), torch.zeros(n_req, 1, vocab)], 1)
        draft_probs = draft_probs.view(-1, vocab)
    layout = VerifyLayout(np.full(n_req, k))
    tokens, _ = verify(logits, _meta(n_req * 3, 1.0), draft_ids, layout, draft_probs)
    tokens = tokens.numpy()
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert _chi2_ok(first, p_rows[0].numpy())
    # a second token where the first draft was accepted: row 1's draw, whatever came first
    has_second = tokens[:, 1] >= 0
    assert (has_second == (tokens[:, 0] == drafts[:, 0].numpy())).all()
    second = np.bincount(tokens[has_second, 1], minlength=vocab)
    assert _chi2_ok(second, p_rows[1].numpy())
    # drafts were accepted sometimes, and rejected sometimes
    accepted = (tokens[:, 0] == drafts[:, 0].numpy()).mean()
    assert 0.05 < accepted < 0.95


def test_seeded_rows_draw_the_same_tokens_again():
    vocab = 7
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    draft_ids = torch.tensor([3, 1, 4, -1])
    layout = VerifyLayout(np.array([3]))

    def draw(seed):
        gens = {i: g for i, g in enumerate([torch.Generator().manual_seed(seed)] * 4)}
        return verify(logits, _meta(4, 0.8, gens), draft_ids, layout)[0].tolist()

    runs = [draw(s) for s in (5, 5, 6, 7, 8)]
    assert runs[0] == runs[1]
    assert any(r != runs[0] for r in runs[2:])


# ---- counters: the stats line and /metrics -----------------------------------------------


def test_stats_line_and_metrics_carry_the_spec_counters():
    pytest.importorskip("prometheus_client")
    from pagellm.engine.stat_logger import StatLogger
    from pagellm.entrypoints.openai.metrics import ServerMetrics
    from pagellm.protocol import SchedulerStats

    logger = StatLogger(10.0)
    assert logger.spec_line(SchedulerStats()) is None  # no drafts: no line
    stats = SchedulerStats(
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=40,
        spec_decode_num_accepted_tokens=30,
        spec_decode_num_accepted_tokens_per_pos=[10, 9, 7, 4],
    )
    line = logger.spec_line(stats)
    assert "Mean acceptance length: 4.00" in line and "Drafted: 40 tokens" in line
    assert "Per-position acceptance rate: 1.000, 0.900, 0.700, 0.400" in line
    assert "Avg Draft acceptance rate: 75.0%" in line
    metrics = ServerMetrics("m")
    metrics.set_scheduler_stats({f: getattr(stats, f) for f in stats.__struct_fields__})
    text = metrics.render().decode()
    assert 'pagellm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0' in text
    assert (
        'pagellm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 7.0'
        in text
    )
