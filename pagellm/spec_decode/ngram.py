"""Prompt lookup (vLLM's `ngram` method): the request's last n tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurred before in its prompt or output, and the
tokens that followed their latest earlier occurrence (with k tokens after it: in a loop the
latest may run into the end) are the drafts. Costs no model: input-
grounded work (editing, quoting, re-formatting a given text) repeats long runs of its input.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts after `tokens` [L] (prompt + outputs), or [] without a match."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # every window but the suffix itself: starts 0 .. length - n - 1
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # the latest with k tokens after it, else the earliest (the most after it)
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []
