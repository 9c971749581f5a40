"""Finished responses kept in memory, for `previous_response_id` and `GET /v1/responses/{id}`.

Each entry is the response object and its conversation as chat messages (the stored
conversation it continued, its input, its output; never its instructions, which a next
response does not inherit, as OpenAI's). Entries are bounded by count
(`--responses-store-max`, the oldest dropped first) and by age (`--responses-store-ttl`
seconds after the response finished); a request with `store: false` keeps nothing. The lists
of a conversation chain share their messages, so a chain of n responses holds n lists of
references, not n copies of the text.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # what GET /v1/responses/{id} answers
    messages: list[dict[str, Any]]  # the conversation, as chat messages
    expires: float  # on the store's clock


class ResponseStore:
    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict]) -> None:
        if self.max_entries <= 0:
            return
        self.entries[response_id] = StoredResponse(response, messages, self.clock() + self.ttl_s)
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, unless it never was, was dropped or has expired."""
        self._evict()
        return self.entries.get(response_id)

    def _evict(self) -> None:
        """Entries expire in the order they came (one ttl for all): drop from the front."""
        now = self.clock()
        while self.entries:
            oldest = next(iter(self.entries.values()))
            if len(self.entries) <= self.max_entries and oldest.expires > now:
                return
            self.entries.popitem(last=False)
