"""The scheduler's side of structured outputs and priorities, with the fake runner of
test_scheduler: a request waits for its grammar without holding blocks or the queue, a failed
grammar fails its request alone, a terminated grammar stops it; "priority" orders the queue."""

from __future__ import annotations

from test_scheduler import EOS, FakeRunner, make_request, make_scheduler, step

from pagellm.core.request import RequestStatus
from pagellm.protocol import FinishReason


class FakeGrammar:
    """StructuredOutputRequest's interface to the scheduler: poll() and accept()."""

    def __init__(self, stop_after: int = 3) -> None:
        self.ready = False
        self.error: str | None = None
        self.stop_after = stop_after
        self.accepted: list[int] = []

    def poll(self) -> bool:
        return self.ready or self.error is not None

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return len(self.accepted) == self.stop_after  # the grammar has terminated


def _constrained(req_id: str, grammar: FakeGrammar, **params):
    request = make_request(req_id, [5, 6, 7, 8, 9], **params)
    request.structured_output = grammar
    return request


def test_waiting_for_grammar_holds_nothing_and_blocks_nobody():
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(stop_after=3)
    g = _constrained("g", grammar, max_tokens=8)
    scheduler.add_request(g)
    scheduler.add_request(make_request("p", [1, 2, 3], max_tokens=2))
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["p"]
    assert g.status == RequestStatus.WAITING_FOR_GRAMMAR and not g.block_hashes
    assert scheduler.kv_cache_manager.get_block_ids("g") == []
    assert scheduler.make_stats().num_waiting_reqs == 1
    grammar.ready = True
    results: dict[str, list] = {}
    for _ in range(6):
        step(scheduler, runner, results)
    # the grammar saw every sampled token and stopped the request at its third
    assert g.status == RequestStatus.FINISHED_STOPPED
    assert grammar.accepted == g.output_token_ids and len(g.output_token_ids) == 3


def test_failed_grammar_fails_its_request_alone():
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar()
    scheduler.add_request(_constrained("bad", grammar))
    scheduler.add_request(make_request("ok", [1, 2, 3], max_tokens=2))
    step(scheduler, runner)
    grammar.error = "invalid regex: Unclosed '('"
    _, outs = step(scheduler, runner)
    failed = [o for o in outs.outputs if o.request_id == "bad"]
    assert failed[0].finish_reason == FinishReason.ABORT and "Unclosed" in failed[0].error
    assert "bad" not in scheduler.requests and not scheduler.waiting_for_grammar
    step(scheduler, runner)
    assert not scheduler.has_unfinished_requests()  # "ok" ran to its max_tokens
    assert scheduler.kv_cache_manager.num_free_blocks == 63


def test_aborting_a_request_that_waits_for_its_grammar():
    scheduler = make_scheduler()
    scheduler.add_request(_constrained("g", FakeGrammar()))
    scheduler.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting_for_grammar and not scheduler.has_unfinished_requests()


def _admission_order(policy: str) -> list[str]:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.policy = policy
    runner = FakeRunner()
    for i, (req_id, priority) in enumerate([("a", 5), ("b", 0), ("c", 5), ("d", -1)]):
        request = make_request(req_id, [1 + i, 2, 3], max_tokens=1, eos=EOS)
        request.priority, request.arrival_time = priority, float(i)
        scheduler.add_request(request)
    order = []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    return order


def test_priority_policy_orders_the_waiting_queue():
    assert _admission_order("fcfs") == ["a", "b", "c", "d"]
    assert _admission_order("priority") == ["d", "b", "a", "c"]
