"""Scheduler, driven by a fake model runner over a fake KV cache.

The fake runner keeps request state as the real one does (new requests in full, cached ones
as diffs) and "computes" a token by writing it into its slot of a fake KV cache. Before
sampling it reads the request's whole context back through its block table, so a wrong
block table, a bad prefix-cache hit or a block overwritten by another request fails loudly.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagellm.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2

NextToken = Callable[[str, list[int]], int]


def content_token(req_id: str, tokens: list[int]) -> int:
    """A fake model: the next token depends only on the context, so recomputation after a
    preemption must give the same tokens."""
    return (sum(tokens) * 31 + len(tokens) * 7) % 1000 + 10


class _RunnerState:
    __slots__ = ("block_ids", "num_computed", "tokens")

    def __init__(self, tokens: list[int], block_ids: list[int], num_computed: int) -> None:
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed = num_computed


class FakeRunner:
    def __init__(self, next_token: NextToken = content_token) -> None:
        self.next_token = next_token
        self.reqs: dict[str, _RunnerState] = {}
        self.kv: dict[int, int] = {}  # slot -> token id "computed" there

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        for req_id, num in so.num_scheduled_tokens.items():  # write the whole batch first
            self._compute(self.reqs[req_id], num)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [self._maybe_sample(r) for r in req_ids])

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            tokens = new.prompt_token_ids + new.output_token_ids
            self.reqs[new.req_id] = _RunnerState(
                tokens, list(new.block_ids), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.reqs[req_id]
            assert state.num_computed == num_computed
            state.block_ids.extend(new_ids)

    def _slot(self, state: _RunnerState, pos: int) -> int:
        block_id = state.block_ids[pos // BLOCK_SIZE]
        assert block_id != 0, "the null block is never part of a block table"
        return block_id * BLOCK_SIZE + pos % BLOCK_SIZE

    def _compute(self, state: _RunnerState, num: int) -> None:
        assert num > 0
        assert state.num_computed + num <= len(state.tokens)
        for pos in range(state.num_computed, state.num_computed + num):
            self.kv[self._slot(state, pos)] = state.tokens[pos]
        state.num_computed += num

    def _maybe_sample(self, req_id: str) -> list[int]:
        state = self.reqs[req_id]
        if state.num_computed < len(state.tokens):
            return []
        context = [self.kv[self._slot(state, pos)] for pos in range(len(state.tokens))]
        assert context == state.tokens, f"{req_id}: KV cache does not hold its tokens"
        token = self.next_token(req_id, state.tokens)
        state.tokens.append(token)
        return [token]


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        async_scheduling=async_scheduling,
    )


def make_request(req_id: str, prompt: list[int], eos: int | None = EOS, **params) -> Request:
    params.setdefault("max_tokens", 8)
    eos_ids = () if eos is None else (eos,)
    return Request(req_id, list(prompt), SamplingParams(**params), eos_token_ids=eos_ids)


def step(
    scheduler: Scheduler, runner: FakeRunner, results: dict[str, list] | None = None
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step, with the budget checks; outputs are collected into `results`."""
    so = checked_schedule(scheduler)
    outs = scheduler.update_from_output(so, runner.execute_model(so))
    if results is not None:
        collect(results, outs)
    return so, outs


def checked_schedule(scheduler: Scheduler) -> SchedulerOutput:
    so = scheduler.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= scheduler.max_num_seqs
    for req_id in so.num_scheduled_tokens:  # never past the token that samples the last output
        r, max_tokens = (
            scheduler.requests[req_id],
            scheduler.requests[req_id].sampling_params.max_tokens,
        )
        last = min(r.num_prompt_tokens + (max_tokens or 10**9), scheduler.max_request_len)
        assert r.num_computed_tokens <= max(last - 1, r.num_prompt_tokens), req_id
    return so


class AsyncStepper:
    """Async scheduling's order: schedule and run step N+1, then update from step N."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def __call__(self, scheduler: Scheduler, runner: FakeRunner, results: dict) -> None:
        queued = None
        if scheduler.has_unfinished_requests():
            so = checked_schedule(scheduler)
            queued = (so, runner.execute_model(so))
        if self.in_flight is not None:
            collect(results, scheduler.update_from_output(*self.in_flight))
        self.in_flight = queued


def run(
    scheduler: Scheduler, runner: FakeRunner, results: dict[str, list] | None = None
) -> dict[str, list]:
    """Step until done; per request: [all its output tokens, its finish reason]."""
    results = {} if results is None else results
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner, results)
    assert not scheduler.has_unfinished_requests()
    return results


def collect(results: dict[str, list], outs: EngineCoreOutputs) -> None:
    for out in outs.outputs:
        tokens, _ = results.get(out.request_id, ([], None))
        results[out.request_id] = [tokens + out.new_token_ids, out.finish_reason]


def reference_outputs(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(content_token("", tokens))
    return tokens[len(prompt) :]


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache_manager.usage == 0.0


# ---- budgets and chunked prefill ---------------------------------------------------------


def test_chunked_prefill_of_a_long_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", list(range(100, 150)), max_tokens=2))
    so, outs = step(scheduler, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (0, [1, 2, 3, 4])
    assert so.num_scheduled_tokens == {"long": 16} and outs.outputs == []
    expected = [(16, [5, 6, 7, 8], 16), (32, [9, 10, 11, 12], 16), (48, [13], 2)]
    for num_computed, new_block_ids, num_scheduled in expected:
        so, outs = step(scheduler, runner)
        assert so.scheduled_new_reqs == []
        cached = so.scheduled_cached_reqs
        assert cached.req_ids == ["long"]
        assert cached.num_computed_tokens == [num_computed]
        assert cached.new_block_ids == [new_block_ids]
        assert so.num_scheduled_tokens == {"long": num_scheduled}
    (out,) = outs.outputs  # the prompt's last chunk samples the first token
    assert len(out.new_token_ids) == 1 and out.finish_reason is None
    so, outs = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"long": 1}
    assert outs.outputs[0].finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(scheduler)


def test_running_requests_first_then_waiting_chunked_to_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", [1, 3, 5]))
    scheduler.add_request(make_request("b", [7] * 5))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 3, "b": 5}
    scheduler.add_request(make_request("c", list(range(30, 50))))
    scheduler.add_request(make_request("d", [9, 9]))
    so, _ = step(scheduler, runner)
    # two decodes, then c takes the rest of the budget; d must wait (FIFO, no budget)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 4, "d": 2}


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [5, 6, 7], max_tokens=2))
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert scheduler.make_stats().num_waiting_reqs == 1
    so, _ = step(scheduler, runner)  # r0, r1 finish (max_tokens=2)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["r2"]
    assert so.finished_req_ids == {"r0", "r1"}


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_keeps_budgets_and_outputs(enable_prefix_caching, async_scheduling):
    rng = random.Random(1234)
    max_model_len = 48
    scheduler = make_scheduler(
        num_blocks=20,
        max_num_seqs=5,
        max_num_batched_tokens=24,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        async_scheduling=async_scheduling,
    )
    runner = FakeRunner()
    stepper = AsyncStepper(scheduler, runner) if async_scheduling else step
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    pending, expected, aborted, results = [], {}, set(), {}
    for i in range(80):
        prompt = rng.choice(prefixes)[: rng.randrange(0, 20)] + [rng.randrange(10, 1000)]
        prompt += [rng.randrange(10, 1000) for _ in range(rng.randrange(0, 24))]
        max_tokens = rng.randrange(1, 16)
        pending.append(make_request(f"r{i}", prompt, eos=None, max_tokens=max_tokens))
        expected[f"r{i}"] = reference_outputs(prompt, max_tokens, max_model_len)
    for _ in range(2000):
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if rng.random() < 0.03 and scheduler.running:
            victim = rng.choice(scheduler.running).request_id
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        in_flight = async_scheduling and stepper.in_flight is not None
        if not pending and not scheduler.has_unfinished_requests() and not in_flight:
            break
        stepper(scheduler, runner, results)
    assert not pending and not scheduler.has_unfinished_requests()
    for req_id, tokens in expected.items():
        if req_id not in aborted:
            assert results[req_id][0] == tokens, req_id
    assert scheduler.num_preemptions > 0  # the workload is tight enough to preempt
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_hits > 0) == enable_prefix_caching
    assert_all_blocks_free(scheduler)


# ---- preemption --------------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_request():
    # 4 usable blocks of 4 tokens; three 3-token prompts take one block each
    scheduler = make_scheduler(num_blocks=5, max_model_len=16)
    runner = FakeRunner()
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 3, eos=None, max_tokens=6))
    results: dict[str, list] = {}
    step(scheduler, runner, results)
    step(scheduler, runner, results)  # position 3 fills each request's first block
    # a takes the last free block; b needs one too and preempts c, the youngest
    so, outs = step(scheduler, runner, results)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[4], [3]]
    assert so.finished_req_ids == {"c"}
    c = scheduler.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert scheduler.waiting[0] is c and [r.request_id for r in scheduler.running] == ["a", "b"]
    assert scheduler.num_preemptions == 1 and scheduler.make_stats().num_preemptions == 1
    assert [o.request_id for o in outs.outputs] == ["a", "b"]
    run(scheduler, runner, results)
    for name in "abc":
        assert results[name][0] == reference_outputs([ord(name)] * 3, 6, 16)


def test_preempted_request_resumes_as_new_with_its_outputs():
    scheduler = make_scheduler(num_blocks=5, max_model_len=16)
    runner = FakeRunner()
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 3, eos=None, max_tokens=6))
    outputs_of_c = []
    for _ in range(30):
        so = scheduler.schedule()
        resumed = [n for n in so.scheduled_new_reqs if n.req_id == "c" and n.output_token_ids]
        if resumed:
            break
        outs = scheduler.update_from_output(so, runner.execute_model(so))
        outputs_of_c += [t for o in outs.outputs if o.request_id == "c" for t in o.new_token_ids]
    (resumed,) = resumed
    assert resumed.output_token_ids == outputs_of_c == reference_outputs([ord("c")] * 3, 2, 16)
    assert resumed.prompt_token_ids == [ord("c")] * 3
    assert scheduler.requests["c"].num_preemptions == 1


def test_request_preempts_itself_when_it_is_the_youngest():
    scheduler = make_scheduler(num_blocks=3, max_model_len=8)  # 2 usable blocks
    runner = FakeRunner()
    scheduler.add_request(make_request("a", [1] * 3, eos=None, max_tokens=3))
    scheduler.add_request(make_request("b", [2] * 4, eos=None, max_tokens=3))
    results: dict[str, list] = {}
    step(scheduler, runner, results)  # a: block 1, 3 tokens; b: block 2, full
    # a computes position 3 in its block; b needs a new block, and the youngest is b itself
    so, _ = step(scheduler, runner, results)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    b = scheduler.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.running] == ["a"]
    run(scheduler, runner, results)
    assert results["a"][0] == reference_outputs([1] * 3, 3, 8)
    assert results["b"][0] == reference_outputs([2] * 4, 3, 8)
    assert_all_blocks_free(scheduler)


# ---- aborts ------------------------------------------------------------------------------


def test_abort_frees_blocks_and_tells_the_runner():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    for name in "abc":
        scheduler.add_request(make_request(name, list(range(10))))
    step(scheduler, runner)  # a, b running; c waiting
    assert scheduler.kv_cache_manager.num_free_blocks < 63
    scheduler.finish_requests(["b", "c", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_num_unfinished_requests() == 0
    assert not scheduler.running and not scheduler.waiting
    assert_all_blocks_free(scheduler)
    so, outs = step(scheduler, runner)
    assert so.finished_req_ids == {"a", "b", "c"} and so.total_num_scheduled_tokens == 0
    assert outs.outputs == [] and runner.reqs == {}
    assert scheduler.schedule().finished_req_ids == set()  # reported once


def test_abort_one_of_several_keeps_the_others_running():
    scheduler = make_scheduler()
    runner = FakeRunner()
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 5, eos=None, max_tokens=4))
    results: dict[str, list] = {}
    step(scheduler, runner, results)
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    so, _ = step(scheduler, runner, results)
    assert list(so.num_scheduled_tokens) == ["a", "c"] and so.finished_req_ids == {"b"}
    run(scheduler, runner, results)
    assert results["a"] == [reference_outputs([ord("a")] * 5, 4, 64), FinishReason.LENGTH]
    assert len(results["b"][0]) == 1 and results["b"][1] is None
    assert_all_blocks_free(scheduler)


def test_finish_requests_rejects_unfinished_status():
    scheduler = make_scheduler()
    with pytest.raises(ValueError):
        scheduler.finish_requests(["a"], RequestStatus.RUNNING)


def test_add_request_rejects_empty_prompts_and_duplicate_ids():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("empty", []))
    scheduler.add_request(make_request("a", [1] * 16))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a", [1]))


def test_prompt_over_max_request_len_finishes_at_once():
    scheduler = make_scheduler(max_model_len=16)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", [1] * 17))
    scheduler.add_request(make_request("ok", [1] * 4, max_tokens=1))
    assert scheduler.get_num_unfinished_requests() == 2
    so, outs = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["ok"]
    long, ok = outs.outputs
    assert long.request_id == "long" and long.new_token_ids == []
    assert long.finish_reason == FinishReason.LENGTH
    assert ok.finish_reason == FinishReason.LENGTH and len(ok.new_token_ids) == 1
    assert not scheduler.has_unfinished_requests()


def test_small_cache_caps_request_length(caplog):
    # 3 usable blocks hold 12 tokens: below max_model_len, requests stop there
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    assert "hold only 12 tokens" in caplog.text
    runner = FakeRunner()
    scheduler.add_request(make_request("a", [1] * 10, eos=None, max_tokens=20))
    scheduler.add_request(make_request("b", [2] * 13))
    results = run(scheduler, runner)
    assert results["a"] == [reference_outputs([1] * 10, 20, 12), FinishReason.LENGTH]
    assert len(results["a"][0]) == 2
    assert results["b"] == [[], FinishReason.LENGTH]
    assert_all_blocks_free(scheduler)


# ---- finishing ---------------------------------------------------------------------------


def run_scripted(
    script: list[int], max_model_len: int = 64, **params
) -> tuple[Request, list[EngineCoreOutput]]:
    """Run one request with prompt [5, 6, 7] against a model that emits `script`."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(lambda req_id, tokens: script[len(tokens) - 3])
    request = make_request("r", [5, 6, 7], **params)
    scheduler.add_request(request)
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1].outputs
    assert all(len(out.new_token_ids) == 1 for out in outputs)
    assert all(not out.finished for out in outputs[:-1])
    assert_all_blocks_free(scheduler)
    return request, outputs


def test_eos_stops():
    request, outputs = run_scripted([20, 21, EOS, 30, 31], max_tokens=16)
    assert request.output_token_ids == [20, 21, EOS]  # EOS is kept in the output
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason is None
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    request, outputs = run_scripted([20, 21, EOS, 30, 31], max_tokens=5, ignore_eos=True)
    assert request.output_token_ids == [20, 21, EOS, 30, 31]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_set_stop_reason():
    request, outputs = run_scripted([20, 21, 22], max_tokens=16, stop_token_ids=[22, 21])
    assert request.output_token_ids == [20, 21]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason == 21


def test_min_tokens_defers_eos_and_stop_tokens():
    script = [EOS, 21, EOS, 30, EOS, 40]
    request, outputs = run_scripted(script, max_tokens=16, min_tokens=4, stop_token_ids=[21])
    assert request.output_token_ids == [EOS, 21, EOS, 30, EOS]
    assert outputs[-1].finish_reason == FinishReason.STOP
    request, _ = run_scripted([10, EOS, 11], max_tokens=16, min_tokens=2)
    assert request.output_token_ids == [10, EOS]  # the EOS itself counts toward min_tokens


def test_max_tokens():
    request, outputs = run_scripted(list(range(10, 20)), max_tokens=3)
    assert request.output_token_ids == [10, 11, 12]
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_length_wins_over_eos_on_the_same_token():
    _, outputs = run_scripted([20, EOS], max_tokens=2)
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_max_model_len():
    request, outputs = run_scripted(list(range(10, 30)), max_model_len=8, max_tokens=None)
    assert request.output_token_ids == [10, 11, 12, 13, 14]  # 3 + 5 = max_model_len
    assert request.num_computed_tokens == 7  # the last token is never computed
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_prompt_of_max_model_len_samples_one_token():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("r", list(range(30, 38)), eos=None))
    results = run(scheduler, FakeRunner())
    assert len(results["r"][0]) == 1 and results["r"][1] == FinishReason.LENGTH


# ---- outputs and stats -------------------------------------------------------------------


def test_prefix_cache_hits_in_stats_and_first_output():
    scheduler = make_scheduler()
    runner = FakeRunner()
    shared = list(range(40, 48))
    scheduler.add_request(make_request("a", shared + [100], eos=None, max_tokens=2))
    first = run(scheduler, runner)
    scheduler.add_request(make_request("b", shared + [200, 201], eos=None, max_tokens=2))
    so, outs = step(scheduler, runner)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 2}
    assert new.block_ids[:2] == [1, 2]  # a's blocks, kept in the cache after a finished
    assert outs.outputs[0].num_cached_tokens == 8
    stats = outs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 10, 8)
    _, outs = step(scheduler, runner)
    assert outs.outputs[0].num_cached_tokens == 0  # only on the first output
    assert first["a"][1] == FinishReason.LENGTH


def test_cached_tokens_count_from_the_first_scheduling():
    """A request preempted during its prefill hits its own computed blocks when it resumes;
    its first output still says what the cache held when it was first scheduled."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner()
    scheduler.add_request(make_request("c", list(range(70, 82)), eos=None, max_tokens=2))
    step(scheduler, runner)  # the first chunk: one full block, now in the prefix cache
    request = scheduler.requests["c"]
    scheduler.running.remove(request)  # preempted, as `_allocate_or_preempt` does it
    scheduler._preempt(request)
    so, _ = step(scheduler, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == BLOCK_SIZE  # a hit of its own block
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1].outputs
    assert [o.num_cached_tokens for o in outputs if o.new_token_ids] == [0, 0]


def test_prefix_hit_within_one_step():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(60, 72))  # three full blocks
    scheduler.add_request(make_request("a", prompt, eos=None, max_tokens=3))
    scheduler.add_request(make_request("b", prompt, eos=None, max_tokens=3))
    so, outs = step(scheduler, runner)
    a, b = so.scheduled_new_reqs
    # b reuses the blocks a fills in this very step (KV is written before it is read)
    assert a.block_ids == [1, 2, 3] and b.block_ids == [1, 2, 4]
    assert so.num_scheduled_tokens == {"a": 12, "b": 4}
    assert [out.num_cached_tokens for out in outs.outputs] == [0, 8]
    results = run(
        scheduler, runner, {out.request_id: [out.new_token_ids, None] for out in outs.outputs}
    )
    assert results["a"][0] == results["b"][0] == reference_outputs(prompt, 3, 64)


def test_logprobs_are_passed_through():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], logprobs=1))
    scheduler.add_request(make_request("b", [4, 5, 6]))  # no logprobs asked
    so = scheduler.schedule()
    # the runner computed the step's largest k (2) for every sampling row (one row per
    # sampled token)
    mro = ModelRunnerOutput(
        ["a", "b"],
        [[10], [11]],
        logprobs=[[[-0.5, -0.5, -1.5]], [[-0.1, -0.1, -2.5]]],
        logprob_token_ids=[[[10, 10, 3]], [[11, 11, 7]]],
        logprob_ranks=[[1], [1]],
    )
    out_a, out_b = scheduler.update_from_output(so, mro).outputs
    assert out_a.new_logprobs == [[-0.5, -0.5]] and out_a.new_top_logprob_ids == [[10, 10]]
    assert out_a.new_logprob_ranks == [1]
    assert out_b.new_logprobs is None and out_b.new_top_logprob_ids is None


def test_output_for_a_request_aborted_after_scheduling_is_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    so = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = scheduler.update_from_output(so, ModelRunnerOutput(["a"], [[10]]))
    assert outs.outputs == []


def test_stats_counts_and_log_stats_off():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    scheduler.add_request(make_request("b", [1, 2, 3]))
    _, outs = step(scheduler, FakeRunner())
    stats = outs.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(1 / 63)
    quiet = Scheduler(SchedulerConfig(), CacheConfig(), 200, log_stats=False)
    quiet.add_request(make_request("a", [1, 2, 3]))
    so = quiet.schedule()
    assert quiet.update_from_output(so, ModelRunnerOutput(["a"], [[5]])).scheduler_stats is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_long_rope_switch_recomputes_with_the_long_factors(async_scheduling):
    """A longrope model (switch k = 10 tokens): a prompt over k is long from its first step;
    a request that computes its position k is recomputed whole as a long one (as HF Phi-3's
    `generate` does), not counted as a preemption; long and short requests never share
    prefix-cache blocks, long ones do."""
    scheduler = Scheduler(
        SchedulerConfig(16, 64, 64),
        CacheConfig(block_size=BLOCK_SIZE),
        64,
        async_scheduling=async_scheduling,
        long_rope_switch=10,
    )
    runner, results = FakeRunner(), {}
    arrivals: dict[str, list[tuple[bool, int]]] = {}  # (long_rope, num_computed) per arrival
    execute = runner.execute_model

    def recording(so: SchedulerOutput) -> ModelRunnerOutput:
        for new in so.scheduled_new_reqs:
            arrivals.setdefault(new.req_id, []).append((new.long_rope, new.num_computed_tokens))
        return execute(so)

    runner.execute_model = recording
    stepper = AsyncStepper(scheduler, runner) if async_scheduling else step
    long_prompt = list(range(20, 32))  # 12 tokens
    for req_id, prompt, max_tokens in (("long", long_prompt, 4), ("short", long_prompt[:8], 8)):
        scheduler.add_request(make_request(req_id, prompt, eos=None, max_tokens=max_tokens))
        for _ in range(40):
            stepper(scheduler, runner, results)
        assert results[req_id][0] == reference_outputs(prompt, max_tokens, 64), req_id
    assert arrivals["long"] == [(True, 0)]
    # short: no hit on long's blocks of the same 8 tokens; at 11 tokens, back whole as long,
    # its first 8 tokens now found in long's blocks
    assert arrivals["short"] == [(False, 0), (True, 8)]
    assert scheduler.num_preemptions == 0
    assert_all_blocks_free(scheduler)
