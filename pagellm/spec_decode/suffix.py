"""Suffix decoding (`speculative_config={"method": "suffix"}`): drafts from what came before.

Agent loops, code edits and RL rollouts repeat themselves: a tool call's JSON, a file quoted
back, the same reasoning scaffold. `SuffixProposer` drafts the continuation that followed the
current sequence's longest suffix (up to `max_tree_depth` tokens) where it occurred before, in
two places: this request's own prompt and output, and the outputs of the last
`max_cached_requests` finished requests (SuffixDecoding, arXiv:2411.04975).

What a suffix tree with counts answers is answered here from the token arrays themselves. The
current token's occurrences come from an index (token -> positions, the last `MAX_OCCURRENCES`
of them); those that extend the match one token further back are kept (numpy filters), and
those left are the matched node's occurrences. Walking down the tree is filtering them by the
next token. A node's count is its number of occurrences that have a next token, so a child's
empirical probability is its count over its parent's; the draft follows the most frequent
child (ties: the one seen last) while the product of probabilities along the path stays >=
`min_token_prob`. Memory is O(tokens) rather than a tree's O(tokens * depth), appending a
token is O(1), and a proposal costs a few vectorized passes over those occurrences.

Bounds on a draft: `num_speculative_tokens`, the caller's `max_tokens`, and
`max_spec_factor * match_length` (a short match earns a short draft). Of the two candidates
(this request, recent requests) the one with the higher score wins: the sum of its tokens'
path probabilities, the number of tokens expected to be accepted; ties go to the longer match,
then to this request. A running request's output joins the recent outputs when it stops.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

SEPARATOR = -1  # ends each cached output and fills evicted ones: no token matches or follows it
# A match is looked for among the last this many occurrences of the current token, so a
# proposal's work is bounded however common that token is in a long sequence or in thousands
# of cached outputs (a recency window; exact below it).
MAX_OCCURRENCES = 4096
MAX_TOKEN_ID = np.iinfo(np.int32).max


class Draft(NamedTuple):
    """A candidate draft: its tokens, the matched suffix's length and its expected accepted
    length (the sum of the tokens' path probabilities)."""

    token_ids: list[int]
    match_len: int
    score: float


NO_DRAFT = Draft([], 0, 0.0)


class TokenIndex:
    """A growing token array and, per token id, the positions where it occurs (ascending)."""

    __slots__ = ("buf", "size", "positions")

    def __init__(self) -> None:
        self.buf = np.empty(64, dtype=np.int32)
        self.size = 0
        self.positions: dict[int, array] = {}

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.size]

    def extend(self, token_ids: np.ndarray) -> None:
        """Appends `token_ids` (int32, SEPARATOR allowed: it is stored, never indexed)."""
        start, count = self.size, len(token_ids)
        if start + count > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), start + count), dtype=np.int32)
            grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start : start + count] = token_ids
        self.size = start + count
        if count <= 16:
            for offset, token in enumerate(token_ids.tolist()):
                if token != SEPARATOR:
                    self.positions.setdefault(token, array("q")).append(start + offset)
        else:
            self._index_block(token_ids, start)

    def _index_block(self, token_ids: np.ndarray, start: int) -> None:
        """Indexes a long block at once: positions grouped by token with one stable sort."""
        order = np.argsort(token_ids, kind="stable")
        sorted_ids = token_ids[order]
        firsts = np.flatnonzero(np.diff(sorted_ids, prepend=SEPARATOR - 1))
        lasts = np.append(firsts[1:], len(order)).tolist()
        positions = order.astype(np.int64) + start
        for token, first, last in zip(sorted_ids[firsts].tolist(), firsts.tolist(), lasts):
            if token != SEPARATOR:
                self.positions.setdefault(token, array("q")).frombytes(
                    positions[first:last].tobytes()
                )

    def occurrences(self, token: int, limit: int) -> np.ndarray:
        """The last `limit` positions of `token` (a copy: the index's arrays must stay
        resizable)."""
        found = self.positions.get(token)
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.frombuffer(found, dtype=np.int64)[-limit:].copy()


def match_suffix(index: TokenIndex, pattern: np.ndarray) -> tuple[int, np.ndarray]:
    """The longest suffix of `pattern` that occurs in `index` followed by a token: its length
    and the positions of its occurrences' last tokens (0 and empty when none)."""
    tokens = index.tokens
    last = int(pattern[-1])
    ends = index.occurrences(last, MAX_OCCURRENCES)
    ends = ends[ends + 1 < len(tokens)]
    ends = ends[(tokens[ends] == last) & (tokens[ends + 1] != SEPARATOR)]
    if not ends.size:
        return 0, ends
    length = 1
    while length < len(pattern):
        longer = ends[ends >= length]
        longer = longer[tokens[longer - length] == pattern[-1 - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    return length, ends


def most_frequent(next_ids: np.ndarray) -> tuple[int, int]:
    """The most frequent id (ties: the one whose last occurrence is latest) and its count."""
    first = next_ids[0]
    if (next_ids == first).all():
        return int(first), len(next_ids)
    if len(next_ids) <= 64:  # a Counter is quicker than np.unique on a few ids
        ids = next_ids.tolist()
        counts = Counter(ids)
        best = max(counts.values())
        return next(token for token in reversed(ids) if counts[token] == best), best
    uniq, first_from_end, counts = np.unique(next_ids[::-1], return_index=True, return_counts=True)
    tied = np.flatnonzero(counts == counts.max())
    best = tied[np.argmin(first_from_end[tied])]
    return int(uniq[best]), int(counts[best])


def walk(
    tokens: np.ndarray, ends: np.ndarray, max_len: int, min_token_prob: float
) -> tuple[list[int], float]:
    """Follows the most frequent continuation of the occurrences ending at `ends` while the
    path probability stays >= `min_token_prob`: the draft and its score."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < max_len:
        nxt = ends + 1
        nxt = nxt[nxt < len(tokens)]
        next_ids = tokens[nxt]
        keep = next_ids != SEPARATOR
        nxt, next_ids = nxt[keep], next_ids[keep]
        if not nxt.size:
            break
        if nxt.size == 1:  # one occurrence left: the rest of it, probability 1 a token
            tail = tokens[nxt[0] : nxt[0] + max_len - len(draft)]
            cut = np.flatnonzero(tail == SEPARATOR)
            tail = tail[: cut[0]] if cut.size else tail
            for token in tail.tolist():  # one addition a token, as the general path sums
                draft.append(token)
                score += prob
            break
        token, count = most_frequent(next_ids)
        if prob * count / len(next_ids) < min_token_prob:
            break
        prob *= count / len(next_ids)
        draft.append(token)
        score += prob
        ends = nxt[next_ids == token]
    return draft, score


class RecentOutputs:
    """The outputs of the last `max_requests` finished requests, one array with a SEPARATOR
    after each; the oldest is evicted (overwritten with SEPARATOR), and the array is rebuilt
    without the evicted ones once they outnumber the live tokens (amortized O(1) a token)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.index = TokenIndex()
        self.segments: deque[tuple[int, int]] = deque()  # [start, end) of each output
        self.dead_tokens = 0

    def add(self, output_ids: np.ndarray) -> None:
        if self.max_requests <= 0 or not len(output_ids):
            return
        start = self.index.size
        self.index.extend(np.append(output_ids, np.int32(SEPARATOR)))
        self.segments.append((start, start + len(output_ids)))
        while len(self.segments) > self.max_requests:
            self._evict_oldest()
        if self.dead_tokens > self.index.size - self.dead_tokens:
            self._compact()

    def _evict_oldest(self) -> None:
        start, end = self.segments.popleft()
        self.index.buf[start:end] = SEPARATOR
        self.dead_tokens += end - start + 1

    def _compact(self) -> None:
        tokens = self.index.tokens
        live = [tokens[start : end + 1] for start, end in self.segments]
        self.index, self.segments, self.dead_tokens = TokenIndex(), deque(), 0
        start = 0
        for block in live:
            self.segments.append((start, start + len(block) - 1))
            start += len(block)
        if live:
            self.index.extend(np.concatenate(live))


class SuffixProposer:
    """Draft tokens for each running request from its own tokens and recent requests' outputs.

    The runner calls `start_request` when a request arrives, `add_tokens` with the tokens it
    accepts each step, `propose` for the next step's drafts and `stop_request` when it ends
    (finished or aborted: its output then joins the recent outputs)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        _check_settings(
            num_speculative_tokens, max_tree_depth, max_cached_requests, max_spec_factor,
            min_token_prob,
        )  # fmt: skip
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.recent = RecentOutputs(max_cached_requests)
        self.requests: dict[str, tuple[TokenIndex, int]] = {}  # id -> (tokens, prompt length)

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Begins (or begins again) `req_id` with its prompt."""
        index = TokenIndex()
        prompt = _as_token_array(prompt_token_ids, req_id)
        index.extend(prompt)
        self.requests[req_id] = (index, len(prompt))

    def add_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Appends `req_id`'s newly accepted output tokens, in order."""
        index, _ = self._request(req_id)
        if len(token_ids):
            index.extend(_as_token_array(token_ids, req_id))

    def stop_request(self, req_id: str) -> None:
        """Ends `req_id`: its output joins the recent outputs. An unknown id is ignored, so a
        request stopped twice (finished, then aborted) is harmless."""
        entry = self.requests.pop(req_id, None)
        if entry is not None:
            index, prompt_len = entry
            self.recent.add(index.tokens[prompt_len:].copy())

    def propose(self, req_id: str, max_tokens: int) -> list[int]:
        """At most min(max_tokens, num_speculative_tokens) draft ids for `req_id`, maybe []."""
        index, _ = self._request(req_id)
        limit = min(max_tokens, self.num_speculative_tokens)
        if limit <= 0 or index.size == 0:
            return []
        pattern = index.tokens[-self.max_tree_depth :]
        own = self._draft(index, pattern, limit)
        other = self._draft(self.recent.index, pattern, limit)
        return max(own, other, key=lambda d: (d.score, d.match_len)).token_ids

    def _draft(self, index: TokenIndex, pattern: np.ndarray, limit: int) -> Draft:
        if index.size == 0:
            return NO_DRAFT
        match_len, ends = match_suffix(index, pattern)
        max_len = min(limit, int(self.max_spec_factor * match_len + 1e-9))
        if max_len <= 0:
            return NO_DRAFT
        token_ids, score = walk(index.tokens, ends, max_len, self.min_token_prob)
        return Draft(token_ids, match_len, score) if token_ids else NO_DRAFT

    def _request(self, req_id: str) -> tuple[TokenIndex, int]:
        entry = self.requests.get(req_id)
        if entry is None:
            raise KeyError(
                f"suffix decoding: request {req_id!r} was not started (or was stopped); "
                "call start_request first"
            )
        return entry


def _as_token_array(token_ids: Sequence[int], req_id: str) -> np.ndarray:
    """`token_ids` as int32, each a token id (>= 0)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise ValueError(f"suffix decoding: request {req_id!r} has a token id out of range")
    return ids.astype(np.int32)


def _check_settings(
    num_speculative_tokens: int,
    max_tree_depth: int,
    max_cached_requests: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> None:
    """The suffix method's settings, each in range (vLLM's meanings)."""
    problems = []
    if num_speculative_tokens < 1:
        problems.append(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if max_tree_depth < 1:
        problems.append(f"suffix_decoding_max_tree_depth must be >= 1, got {max_tree_depth}")
    if max_cached_requests < 0:
        problems.append(
            f"suffix_decoding_max_cached_requests must be >= 0, got {max_cached_requests}"
        )
    if not max_spec_factor >= 0:
        problems.append(f"suffix_decoding_max_spec_factor must be >= 0, got {max_spec_factor}")
    if not 0 <= min_token_prob <= 1:
        problems.append(f"suffix_decoding_min_token_prob must be in [0, 1], got {min_token_prob}")
    if problems:
        raise ValueError("speculative_config: " + "; ".join(problems))
