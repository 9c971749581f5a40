"""How many drafts a request gets: as many as pay for themselves at its measured acceptance.

Verifying k drafts makes a step cost about 1 + c k times a plain one (c: the marginal cost
of one more query token a request, small where decode reads weights from memory) and yields
1 + a + a^2 + ... + a^k tokens on average when each draft is accepted with probability a
(the request's running acceptance, an exponential average over its verified drafts). The
request gets the k in 0..num_speculative_tokens with the most tokens per unit of cost: no
drafts once they keep failing, so speculation never costs more than it saves. A request held
at 0 is given one draft every `PROBE_EVERY` steps, to notice when its text turns repetitive.

c is measured where a step's time can be (`StepCosts`: the CPU, whose forward is eager and
synchronous: there one more row costs a third to a half of a one-row step, its weights read
once but every row's products computed); on a GPU the host cannot time a queued step, and
c keeps its default (0.1: decode reads the weights, the extra rows nearly free).
"""

from __future__ import annotations

import numpy as np

PROBE_EVERY = 8  # steps without drafts between two one-draft probes
_WEIGHT = 0.2  # of the newest verified draft in the running acceptance
_START = 0.6  # a new request's acceptance: optimistic, drafts from its first step


class AdaptiveDrafts:
    def __init__(self, max_drafts: int, draft_cost: float = 0.1, enabled: bool = True) -> None:
        self.max_drafts = max_drafts
        self.draft_cost = draft_cost
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
            rate = expected / (1 + self.draft_cost * k)
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
    """c from the decode steps' wall times: a running mean for each row count, a line
    T(n) = a + b n fitted through them, and c = b / T(1) (the cost of one more row relative
    to a one-row step; with more requests a step costs more and c overstates a draft's
    share, erring towards fewer drafts)."""

    REFIT_EVERY = 16  # steps between two fits
    _WEIGHT = 0.1  # of the newest time in a row count's running mean

    def __init__(self, max_rows: int, default: float) -> None:
        self.mean = np.zeros(max_rows + 1)  # seconds, by rows in the step
        self.seen = np.zeros(max_rows + 1, bool)
        self.cost = default
        self.steps = 0

    def record(self, num_rows: int, seconds: float) -> float:
        """Take a decode step's time in; the current c."""
        if num_rows < len(self.mean):
            if self.seen[num_rows]:
                self.mean[num_rows] += self._WEIGHT * (seconds - self.mean[num_rows])
            else:
                self.mean[num_rows], self.seen[num_rows] = seconds, True
        self.steps += 1
        if self.steps % self.REFIT_EVERY == 0:
            self.cost = self._fit()
        return self.cost

    def _fit(self) -> float:
        rows = np.flatnonzero(self.seen)
        if len(rows) < 2:
            return self.cost
        b, a = np.polyfit(rows, self.mean[rows], 1)
        one_row = a + b
        if one_row <= 0:
            return self.cost
        return float(np.clip(b / one_row, 0.02, 2.0))
