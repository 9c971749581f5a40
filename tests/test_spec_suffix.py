"""Suffix decoding's proposer (`pagellm/spec_decode/suffix.py`), no model.

Exact drafts on hand-made sequences (agent loops, finished requests, probabilities, the match
length bound, eviction), a brute-force reference over random sequences of a small alphabet
(this request and recent requests, with evictions and rebuilds), bad input, and CPU-time
bounds.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from pagellm.spec_decode.suffix import SuffixProposer

TOOL_CALL = [500, 501, 502, 503, 504, 505, 506, 507]  # e.g. '{"name": "search", "args": ...'


def test_agent_loop_gets_the_repeated_continuation() -> None:
    proposer = SuffixProposer(num_speculative_tokens=5)
    proposer.start_request("a", [1, 2, 3, 4])
    proposer.add_tokens("a", TOOL_CALL + [600, 601])  # first call, then its result
    proposer.add_tokens("a", TOOL_CALL[:5])  # the loop comes round again
    assert proposer.propose("a", max_tokens=16) == TOOL_CALL[5:] + [600, 601]
    assert proposer.propose("a", max_tokens=2) == TOOL_CALL[5:7]  # the caller's bound
    proposer.add_tokens("a", TOOL_CALL[5:] + [600])
    assert proposer.propose("a", max_tokens=16) == [601] + TOOL_CALL[:4]  # and round again


def test_pattern_of_a_finished_request_is_proposed_for_a_new_one() -> None:
    proposer = SuffixProposer(num_speculative_tokens=6)
    proposer.start_request("first", [9, 9, 9])
    proposer.add_tokens("first", [70, 71, 72, 73, 74, 75, 76])
    proposer.start_request("second", [40, 41, 70, 71, 72])
    assert proposer.propose("second", 16) == []  # "first" is still running: not shared yet
    proposer.stop_request("first")
    assert proposer.propose("second", 16) == [73, 74, 75]  # 3 matched, at most 3 drafted
    proposer.add_tokens("second", [73])
    assert proposer.propose("second", 16) == [74, 75, 76]
    with pytest.raises(KeyError, match="'first'"):
        proposer.propose("first", 4)  # its own tokens were dropped


def finished(proposer: SuffixProposer, outputs: list[list[int]]) -> None:
    for i, output in enumerate(outputs):
        proposer.start_request(f"done-{i}", [])
        proposer.add_tokens(f"done-{i}", output)
        proposer.stop_request(f"done-{i}")


def test_min_token_prob_cuts_the_draft_on_the_path_probability() -> None:
    # after 1 2 3 4 5 6 7: 9 three times in four (0.75); after ... 7 9: 10 twice in three,
    # so the path's probability there is 0.75 * 2/3 = 0.5, each step's alone above 0.6
    outputs = [[1, 2, 3, 4, 5, 6, 7, 9, 10], [1, 2, 3, 4, 5, 6, 7, 9, 10]]
    outputs += [[1, 2, 3, 4, 5, 6, 7, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8]]
    drafts = {}
    for min_prob in (0.4, 0.6, 0.8):
        proposer = SuffixProposer(8, max_spec_factor=2.0, min_token_prob=min_prob)
        finished(proposer, outputs)
        proposer.start_request("new", [50, 1, 2, 3, 4])
        drafts[min_prob] = proposer.propose("new", 16)
    assert drafts == {0.4: [5, 6, 7, 9, 10], 0.6: [5, 6, 7, 9], 0.8: [5, 6, 7]}


def test_ties_go_to_the_continuation_seen_last() -> None:
    proposer = SuffixProposer(4, min_token_prob=0.0)
    proposer.start_request("a", [1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 3])
    assert proposer.propose("a", 4) == [7, 1, 2]
    proposer.start_request("a", [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3])  # started again: reset
    assert proposer.propose("a", 4) == [8, 1, 2]


@pytest.mark.parametrize(
    "factor, draft", [(0.4, []), (0.5, [105]), (1.0, [105, 106]), (2.0, [105, 106, 107, 108])]
)
def test_max_spec_factor_bounds_the_draft_by_the_match_length(factor, draft) -> None:
    proposer = SuffixProposer(8, max_spec_factor=factor)
    proposer.start_request("a", [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 50, 103, 104])
    assert proposer.propose("a", 16) == draft  # "103 104" matched: 2 tokens


@pytest.mark.parametrize("cached", [2, 3])
def test_eviction_forgets_the_oldest_request(cached) -> None:
    proposer = SuffixProposer(4, max_cached_requests=cached)
    finished(proposer, [[80, 81, 82], [30, 31, 32, 33], [40, 41, 42]])
    proposer.start_request("new", [7, 79, 80])  # 80 only in the oldest
    assert proposer.propose("new", 4) == ([81] if cached == 3 else [])  # 1 matched, 1 drafted
    proposer.add_tokens("new", [81])
    assert proposer.propose("new", 4) == ([82] if cached == 3 else [])


def test_no_proposal_without_a_repeated_suffix() -> None:
    proposer = SuffixProposer(5)
    finished(proposer, [[1000, 1001, 1002]])
    proposer.start_request("a", list(range(200)))
    assert proposer.propose("a", 5) == []
    proposer.add_tokens("a", [300, 301])
    assert proposer.propose("a", 5) == []
    proposer.start_request("empty", [])
    assert proposer.propose("empty", 5) == []


def test_bad_calls_are_clear_errors() -> None:
    proposer = SuffixProposer(3)
    with pytest.raises(KeyError, match="'nope' was not started"):
        proposer.add_tokens("nope", [1])
    with pytest.raises(KeyError, match="'nope' was not started"):
        proposer.propose("nope", 3)
    proposer.stop_request("nope")  # stopping twice (finished, then aborted) is harmless
    with pytest.raises(ValueError, match="token id out of range"):
        proposer.start_request("a", [1, -1])
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob must be in"):
        SuffixProposer(3, min_token_prob=1.5)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SuffixProposer(0)


def test_memory_is_bounded_by_the_cached_requests() -> None:
    proposer = SuffixProposer(4, max_cached_requests=3)
    finished(proposer, [[i, i + 1, i + 2, i + 3] for i in range(0, 2000, 4)])
    assert proposer.recent.index.size <= 2 * 3 * 5  # evicted outputs' tokens are dropped
    assert sum(len(p) for p in proposer.recent.index.positions.values()) <= 2 * 3 * 4
    proposer.start_request("new", [1992])
    assert proposer.propose("new", 4) == [1993]


# The reference: every occurrence of every suffix found by scanning, as a suffix tree with
# counts would answer, in plain Python.


def reference_draft(sources, pattern, depth, limit, factor, min_prob):
    """(draft, match length, score) from `sources` (each a token list, oldest first)."""
    pattern, ends, match_len = pattern[-depth:], [], 0
    for length in range(1, len(pattern) + 1):
        found = [
            (s, i + length - 1)
            for s, seq in enumerate(sources)
            for i in range(len(seq) - length)  # followed by a token
            if seq[i : i + length] == pattern[-length:]
        ]
        if not found:
            break
        ends, match_len = found, length
    draft, prob, score = [], 1.0, 0.0
    while len(draft) < min(limit, int(factor * match_len + 1e-9)):
        nexts = [sources[s][e + 1] for s, e in ends if e + 1 < len(sources[s])]
        if not nexts:
            break
        counts = Counter(nexts)
        last_seen = {token: i for i, token in enumerate(nexts)}
        token = max(counts, key=lambda t: (counts[t], last_seen[t]))
        if prob * counts[token] / len(nexts) < min_prob:
            break
        prob *= counts[token] / len(nexts)
        draft.append(token)
        score += prob
        ends = [(s, e + 1) for s, e in ends if e + 1 < len(sources[s])]
        ends = [(s, e) for s, e in ends if sources[s][e] == token]
    return draft, match_len, score


def reference_propose(sequence, recent, settings, max_tokens):
    depth, k, factor, min_prob = settings
    limit = min(k, max_tokens)
    own = reference_draft([sequence], sequence, depth, limit, factor, min_prob)
    other = reference_draft(recent, sequence, depth, limit, factor, min_prob)
    key = lambda d: (d[2], d[1]) if d[0] else (0.0, 0)  # noqa: E731
    return max(own, other, key=key)[0]


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_a_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    settings = (rng.choice([2, 3, 5, 24]), rng.choice([1, 3, 6]), rng.choice([0.5, 1, 2.5]),
                rng.choice([0.0, 0.1, 0.3, 0.6]))  # fmt: skip
    cached = rng.choice([0, 1, 3])
    proposer = SuffixProposer(settings[1], settings[0], cached, settings[2], settings[3])
    recent: list[list[int]] = []
    checked = 0
    for r in range(8):
        alphabet = rng.randint(2, 4)
        sequence = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        proposer.start_request(f"r{r}", sequence)
        output: list[int] = []
        for _ in range(rng.randint(0, 40)):
            max_tokens = rng.randint(0, 7)
            want = reference_propose(sequence, recent, settings, max_tokens)
            assert proposer.propose(f"r{r}", max_tokens) == want, (sequence, recent, settings)
            checked += bool(want)
            new = [rng.randrange(alphabet) for _ in range(rng.choice([1, 1, 1, 3]))]
            proposer.add_tokens(f"r{r}", new)
            sequence, output = sequence + new, output + new
        proposer.stop_request(f"r{r}")
        recent = (recent + [output] if output else recent)[-cached:] if cached else []
    assert checked > 20  # the comparisons were not all of empty drafts


@pytest.mark.parametrize("seed", range(3))
def test_long_sequences_equal_the_reference(seed: int) -> None:
    """Short matches in long sequences: hundreds of occurrences to count (numpy's path)."""
    rng = random.Random(seed)
    settings = (rng.choice([1, 2, 3]), 4, 4.0, rng.choice([0.0, 0.3]))
    proposer = SuffixProposer(4, settings[0], 2, 4.0, settings[3])
    recent = [[rng.randrange(3) for _ in range(300)] for _ in range(2)]
    finished(proposer, recent)
    sequence = [rng.randrange(3) for _ in range(300)]
    proposer.start_request("long", sequence)
    for _ in range(10):
        assert proposer.propose("long", 4) == reference_propose(sequence, recent, settings, 4)
        new = [rng.randrange(3)]
        proposer.add_tokens("long", new)
        sequence = sequence + new


def test_cpu_time_is_bounded() -> None:
    rng = random.Random(0)
    proposer = SuffixProposer(5)
    for i in range(1000):  # recent outputs where token 7 is every other token
        proposer.start_request(f"old{i}", [])
        proposer.add_tokens(f"old{i}", [7 if rng.random() < 0.5 else rng.randrange(1000)
                                        for _ in range(200)] + TOOL_CALL)  # fmt: skip
        proposer.stop_request(f"old{i}")
    start = time.thread_time()
    proposer.start_request("a", [rng.randrange(2000) for _ in range(1000)])
    for step in range(10_000):
        proposer.add_tokens("a", [rng.randrange(200) if step % 50 else 500])
        proposer.propose("a", 5)
    assert time.thread_time() - start < 2.0  # 10k appends and proposals
    proposer.start_request("long", [7 if i % 2 else rng.randrange(50) for i in range(4096)])
    start, drafts = time.thread_time(), []
    for _ in range(200):  # ending in 7: ~100k occurrences in the recent outputs, 2k here
        drafts.append(proposer.propose("long", 5))
        proposer.add_tokens("long", [7])
    assert (time.thread_time() - start) / 200 < 1e-3  # a 4k-token sequence: under 1 ms each
    assert drafts[-1] == [7] * 5  # the run of 7s goes on
