"""The scheduler's side of speculative decoding: which drafts a step verifies, the rollback
of the rejected ones, and the counters of `/metrics` and the stats line.

A request with k drafts is scheduled for its next token and the k drafts after it (1 + k
tokens of the budget and KV slots; fewer drafts where the budget, max_tokens or the model's
length cut them). The runner returns the accepted drafts and one token more; the slots of
the rejected drafts are computed again: `num_computed_tokens` steps back over them, the next
step writes its tokens there, and blocks held only for them go back to the pool when the
request is scheduled next (`KVCacheManager.allocate_slots`). Drafts never enter the prefix
cache: a block is cached only once its tokens are known (accepted).
"""

from __future__ import annotations

from pagellm.core.request import Request, RequestStatus
from pagellm.protocol import EngineCoreOutput


def drafts_in_step(request: Request, num_new: int) -> list[int]:
    """The drafts among the `num_new` tokens just scheduled for `request` (those after its
    known tokens); its proposal is used up either way."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    num_known = request.num_tokens + request.num_output_placeholders
    return drafts[: max(0, request.num_computed_tokens + num_new - num_known)]


def take_proposal(request: Request, proposals: dict[str, list[int]] | None) -> None:
    """The runner's drafts for the request's next step, where they can be used: not for a
    request with a step in flight (async scheduling: they follow a token now behind it); a
    grammar's request keeps those up to the first one its grammar refuses."""
    if not proposals or request.is_finished or request.num_output_placeholders:
        return
    drafts = proposals.get(request.request_id, [])
    grammar = request.structured_output
    if drafts and grammar is not None and grammar.matcher is not None:
        grammar.sync(request.output_token_ids)
        drafts = grammar.valid_drafts(drafts)
    request.spec_token_ids = drafts


class SpecDecodeStats:
    """Since start: verify steps of a request with drafts, drafts, accepted drafts, and the
    accepted ones by position (vLLM's `spec_decode_*` counters)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def verified(
        self, request: Request, output: EngineCoreOutput, num_drafts: int, num_sampled: int
    ) -> None:
        """A step verified `num_drafts` drafts of `request` and sampled `num_sampled` tokens:
        count them (in its `output` too), and step its computed tokens back over the
        rejected ones."""
        num_accepted = num_sampled - 1
        output.num_draft_tokens, output.num_accepted_tokens = num_drafts, num_accepted
        if request.status == RequestStatus.RUNNING:  # not preempted since
            request.num_computed_tokens -= num_drafts - num_accepted
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def fields(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
