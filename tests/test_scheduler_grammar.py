"""The scheduler's side of structured outputs and priorities, with the fake runner of
test_scheduler: a request waits for its grammar without holding blocks or the queue, a failed
grammar fails its request alone, a terminated grammar stops it, a compile past its time limit
fails its request while the engine carries on, an aborted request's queued compile is
cancelled; "priority" orders the queue."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from test_scheduler import EOS, FakeRunner, make_request, make_scheduler, step

from pagellm.config import StructuredOutputsConfig
from pagellm.core.request import RequestStatus
from pagellm.protocol import FinishReason
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.structured_output.params import StructuredOutputsParams


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

    def release(self) -> None:
        pass


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


class GatedBackend:
    """The manager's backend, compiling nothing until `gate` opens (a slow compile)."""

    reasoning_ids = None

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started: list[str] = []

    def compile(self, key: tuple[str, str], grammar: object) -> object:
        self.started.append(key[1])
        self.gate.wait(30)
        return object()


def _manager(compile_timeout_s: float = 30.0) -> tuple[StructuredOutputManager, GatedBackend]:
    """A manager whose compiles run one at a time in one thread, on a gated backend."""
    limits = StructuredOutputsConfig(compile_timeout_s=compile_timeout_s)
    manager = StructuredOutputManager(None, max_num_seqs=16, limits=limits)
    manager.executor.shutdown()
    manager.executor = ThreadPoolExecutor(1)
    manager._backend = backend = GatedBackend()
    return manager, backend


def _regex(req_id: str, regex: str, manager: StructuredOutputManager):
    request = make_request(
        req_id, [5, 6, 7], structured_outputs=StructuredOutputsParams(regex=regex)
    )
    manager.add_request(request)
    return request


def test_a_compile_past_its_time_limit_fails_its_request_alone():
    manager, backend = _manager(compile_timeout_s=0.3)
    scheduler, runner = make_scheduler(), FakeRunner()
    start, results, failed = time.monotonic(), {}, []
    slow = _regex("slow", "a+", manager)
    scheduler.add_request(slow)
    scheduler.add_request(make_request("free", [1, 2, 3], max_tokens=40))
    while not failed:
        assert time.monotonic() - start < 5, "the request waited past its time limit"
        _, outs = step(scheduler, runner, results)
        failed = [o for o in outs.outputs if o.request_id == "slow"]
    assert 0.3 <= time.monotonic() - start < 2
    assert failed[0].finish_reason == FinishReason.ABORT
    assert "did not compile within 0.3 s" in failed[0].error
    assert "over the limit compile_timeout_s=0.3" in failed[0].error
    assert "slow" not in scheduler.requests
    assert len(results["free"][0]) == 40  # ran meanwhile
    scheduler.add_request(make_request("after", [1, 2, 4], max_tokens=5))
    while scheduler.has_unfinished_requests():  # the engine carries on
        step(scheduler, runner, results)
    assert results["after"][1] == FinishReason.LENGTH and len(results["after"][0]) == 5
    backend.gate.set()
    manager.shutdown()


def test_aborting_a_request_cancels_its_queued_compile():
    manager, backend = _manager()
    scheduler = make_scheduler()
    running = _regex("running", "a+", manager)  # compiling: the one thread is busy with it
    queued = _regex("queued", "b+", manager)
    shared = [_regex(f"shared{i}", "c+", manager) for i in range(2)]  # one compile, two waiting
    for request in (running, queued, *shared):
        scheduler.add_request(request)
    scheduler.finish_requests(["queued", "shared0"], RequestStatus.FINISHED_ABORTED)
    assert queued.structured_output.future.cancelled()
    assert ("regex", "b+") not in manager._cache  # a later request compiles it anew
    assert not shared[1].structured_output.future.cancelled()  # shared1 still waits for it
    scheduler.finish_requests(["shared1", "running"], RequestStatus.FINISHED_ABORTED)
    assert shared[1].structured_output.future.cancelled()
    assert not running.structured_output.future.cancelled()  # started: it runs to its end
    backend.gate.set()
    running.structured_output.future.result(timeout=10)
    assert backend.started == ["a+"] and not manager._waiters
    manager.shutdown()


def test_an_internal_compile_error_is_logged_not_echoed():
    manager, backend = _manager()
    backend.compile = lambda key, grammar: {}["grammar_expr_data"]  # a bug of ours
    scheduler, runner = make_scheduler(), FakeRunner()
    request = _regex("r", "a+", manager)
    scheduler.add_request(request)
    request.structured_output.future.exception(timeout=30)
    _, outs = step(scheduler, runner)
    error = next(o.error for o in outs.outputs if o.request_id == "r")
    assert error == "its grammar failed to compile (an internal error, logged)"
    manager.shutdown()


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


def test_a_grammar_over_its_budget_fails_its_request_alone():
    """A grammar whose matcher went over max_matcher_ms raises ValueError at its next token:
    that request ends (abort, the message in our words), its blocks free; the other goes on."""

    class DearGrammar(FakeGrammar):
        def accept(self, token_id: int) -> bool:
            if len(self.accepted) == 2:
                raise ValueError("its grammar took 80 ms of CPU to mask the next token")
            return super().accept(token_id)

    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = DearGrammar(stop_after=100)
    grammar.ready = True
    scheduler.add_request(_constrained("dear", grammar, max_tokens=8))
    scheduler.add_request(make_request("ok", [1, 2, 3], max_tokens=6, eos=None))
    outputs: dict[str, list] = {}
    for _ in range(12):
        _, outs = step(scheduler, runner)
        for out in outs.outputs:
            outputs.setdefault(out.request_id, []).append(out)
    last = outputs["dear"][-1]
    assert last.finish_reason == FinishReason.ABORT
    assert last.error == "its grammar took 80 ms of CPU to mask the next token"
    assert sum(len(o.new_token_ids) for o in outputs["ok"]) == 6
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1
