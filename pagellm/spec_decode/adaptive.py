"""How many drafts a request gets: as many as pay for themselves at its measured acceptance.

A step in which a request verifies k drafts costs about 1 + s + c k times a step without
drafts, and yields 1 + a + a^2 + ... + a^k tokens on average when each draft is accepted
with probability a (the request's running acceptance, an exponential average over its
verified drafts). The request gets the k in 0..num_speculative_tokens with the most tokens
per unit of cost: no drafts once they keep failing, so speculation never costs more than it
saves. A request held at 0 is given one draft every `PROBE_EVERY` steps, to notice when its
text turns repetitive.

s and c are measured on the CPU (`StepCosts`): the time from one step's start to the next,
of steps with and without drafts (on a GPU under async scheduling those periods misled: the
defaults, s = 0 and c = 0.1, stay there). c is what one more query row costs: on a GPU
little (decode reads the weights; the extra rows ride along), on a CPU a third to a half of
a one-row step (the weights are read once, but every row's products are computed). s is
what drafting costs beyond the rows: a step's drafts come from its tokens, so the host waits
for them before it schedules the next step, where without drafts it may overlap them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

PROBE_EVERY = 8  # steps without drafts between two one-draft probes
_WEIGHT = 0.2  # of the newest verified draft in the running acceptance
_START = 0.6  # a new request's acceptance: optimistic, drafts from its first step


class AdaptiveDrafts:
    def __init__(self, max_drafts: int, draft_cost: float = 0.1, enabled: bool = True) -> None:
        self.max_drafts = max_drafts
        self.draft_cost = draft_cost  # c
        self.step_cost = 0.0  # s
        self.enabled = enabled
        self.acceptance: dict[str, float] = {}
        self.idle_steps: dict[str, int] = {}  # steps a request has gone without drafts

    def num_drafts(self, req_id: str) -> int:
        """Drafts to propose for the request's next step."""
        if not self.enabled:
            return self.max_drafts
        best = self._best_k(self.acceptance.get(req_id, _START))
        if best > 0:
            self.idle_steps[req_id] = 0
            return best
        idle = self.idle_steps.get(req_id, 0) + 1
        self.idle_steps[req_id] = idle
        return 1 if idle % PROBE_EVERY == 0 else 0

    def _best_k(self, a: float) -> int:
        best_k, best, expected, power = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_drafts + 1):
            power *= a
            expected += power
            rate = expected / (1 + self.step_cost + self.draft_cost * k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of the request and accepted `num_accepted`."""
        a = self.acceptance.get(req_id, _START)
        for hit in [1.0] * num_accepted + [0.0] * (num_accepted < num_drafts):
            a += _WEIGHT * (hit - a)
        self.acceptance[req_id] = a

    def remove(self, req_id: str) -> None:
        self.acceptance.pop(req_id, None)
        self.idle_steps.pop(req_id, None)


class StepCosts:
    """s and c from the steps' periods (the time from a decode step's start to the next
    step's start: everything a step costs, host work and waits included), by the requests in
    the step and the drafts each verified on average: a step without drafts is the unit for
    its batch size; a line through the drafted steps' costs in units of it, by drafts per
    request, gives 1 + s (at 0) and c (the slope). Medians of the recent periods, so an idle
    gap between two requests (a step that waited for work) does not count; a bucket not seen
    for `STALE` steps is left out (the machine's load, or the batch, has changed since)."""

    REFIT_EVERY = 16  # steps between two fits
    WINDOW = 15  # recent periods kept for each (requests, drafts a request) bucket
    STALE = 512  # steps after which a bucket not seen since no longer counts

    def __init__(self, max_drafts: int, draft_cost: float) -> None:
        self.max_drafts = max_drafts
        self.plain: dict[int, deque] = {}  # requests in the step -> periods without drafts
        self.drafted: dict[tuple[int, int], deque] = {}  # (requests, drafts a request) -> ...
        self.last_seen: dict[tuple[int, int], int] = {}  # bucket -> the step it was last seen
        self.draft_cost, self.step_cost = draft_cost, 0.0
        self.steps = 0

    def record(self, num_reqs: int, num_drafts: int, seconds: float) -> None:
        """A decode step of `num_reqs` requests verifying `num_drafts` drafts in all took
        `seconds` to the next step's start."""
        k = 0 if num_drafts == 0 else max(1, round(num_drafts / num_reqs))
        key = (num_reqs, min(self.max_drafts, k))
        if num_drafts == 0:
            self.plain.setdefault(num_reqs, deque(maxlen=self.WINDOW)).append(seconds)
        else:
            self.drafted.setdefault(key, deque(maxlen=self.WINDOW)).append(seconds)
        self.last_seen[key] = self.steps
        self.steps += 1
        if self.steps % self.REFIT_EVERY == 0:
            self._fit()

    def _fit(self) -> None:
        ks, costs = [], []
        for (num_reqs, k), periods in self.drafted.items():
            plain = self.plain.get(num_reqs)
            fresh = self.steps - self.last_seen[num_reqs, k] < self.STALE
            if plain and fresh and self.steps - self.last_seen[num_reqs, 0] < self.STALE:
                ks.append(k)
                costs.append(float(np.median(periods)) / float(np.median(plain)))
        if not ks:
            return
        if len(set(ks)) == 1:  # one draft count seen: all of it in c
            intercept, slope = 1.0, (float(np.mean(costs)) - 1.0) / ks[0]
        else:
            slope, intercept = np.polyfit(ks, costs, 1)
        self.step_cost = float(np.clip(intercept - 1.0, 0.0, 4.0))
        self.draft_cost = float(np.clip(slope, 0.01, 2.0))
