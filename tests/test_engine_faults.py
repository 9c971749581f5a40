"""Faults in the engine: no silent hangs, and a request that fails fails alone.

The EngineCore process runs under `tests/fault_injection.py`, which plants faults that requests
trip by their id: an exception in each of the core's three threads (input socket, output
socket, busy loop) must reach every caller as EngineDeadError within a second; an exception
attributable to one request (adding it, processing its tokens, decoding it, handling its
outputs on the caller's side) must fail that request alone, free its KV blocks, and leave the
others' tokens unchanged. A tiny random model keeps each engine's start-up short.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest
from timing import async_wait_until, scaled, slowdown, wait_until

from pagellm import EngineArgs, SamplingParams
from pagellm.engine import core_client
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.core_client import EngineDeadError
from pagellm.engine.output_processor import OutputProcessor, fan_out
from pagellm.sampling_params import RequestOutputKind

DEATH_DEADLINE_S = 1.0  # the README's promise: a caller hears of a dead core within a second
PROMPTS = [[1, 5, 9, 14, 20], [1, 300, 301, 302], [1, 7000, 8000], [1, 42, 43, 44, 45, 46]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
_FAULT_INJECTION = os.path.join(os.path.dirname(__file__), "fault_injection.py")


@pytest.fixture
def faulty_core(monkeypatch):
    """Engines started in this test run their core under the fault injector."""
    monkeypatch.setattr(core_client, "CORE_PROCESS_ARGS", [_FAULT_INJECTION])


def _args(model: str) -> EngineArgs:
    return EngineArgs(
        model=model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 23
    )


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


# ---- a dead thread is a dead engine, within a second -----------------------------------------


@pytest.mark.parametrize("thread", ["input", "output", "busy"])
def test_a_dead_core_thread_is_engine_dead_error_within_a_second(
    tiny_chat_model, faulty_core, thread
):
    async def main() -> tuple[list[BaseException], float, int]:
        engine = AsyncLLM.from_engine_args(_args(tiny_chat_model))
        try:
            tasks = [
                asyncio.create_task(_consume(engine, {"prompt_token_ids": p}, LONG, f"r{i}"))
                for i, p in enumerate(PROMPTS)
            ]
            await _until_running(engine, len(PROMPTS))
            start = time.monotonic()
            poison = _consume(engine, {"prompt_token_ids": PROMPTS[0]}, LONG, f"die-{thread}")
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, poison, return_exceptions=True), scaled(10, load)
            )
            elapsed = time.monotonic() - start
            with pytest.raises(EngineDeadError):  # and it stays dead
                await _consume(engine, {"prompt_token_ids": PROMPTS[1]}, GREEDY, "after")
            assert engine.errored and thread in str(engine.dead_error)
            return results, elapsed, engine.engine_core.proc.pid
        finally:
            engine.shutdown()

    load = slowdown()  # before the engine's own work: the machine's
    results, elapsed, pid = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    bound = scaled(DEATH_DEADLINE_S, load)
    assert elapsed < bound, f"callers heard of the dead core after {elapsed:.2f} s > {bound:.2f} s"
    assert wait_until(lambda: _gone(pid), 5)


async def _consume(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _until_running(engine: AsyncLLM, n: int) -> None:
    """Until the core has sent tokens for n requests (so the fault hits a busy engine)."""
    states = engine.output_processor.request_states
    started = await async_wait_until(
        lambda: sum(len(s.token_ids) > 0 for s in states.values()) >= n, 60
    )
    assert started, "the requests never started"


# ---- a request that fails, fails alone ----------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_chat_model, loop):
    """One AsyncLLM (a real core process, under the fault injector) for the per-request faults,
    in one event loop for the module."""

    async def start() -> AsyncLLM:
        return AsyncLLM.from_engine_args(_args(tiny_chat_model))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core_client, "CORE_PROCESS_ARGS", [_FAULT_INJECTION])
        engine = loop.run_until_complete(start())
    yield engine
    engine.shutdown()
    pending = asyncio.all_tasks(loop)  # the output handler, cancelled: let it finish
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _run(loop, engine: AsyncLLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Each request's last output, or the exception its iterator raised."""

    async def one(request_id: str, prompt: list[int], params: SamplingParams):
        try:
            return (await _consume(engine, {"prompt_token_ids": prompt}, params, request_id))[-1]
        except Exception as e:
            return e

    async def main() -> list:
        runs = (one(rid, prompt, params) for rid, (prompt, params) in requests.items())
        return await asyncio.wait_for(asyncio.gather(*runs), scaled(60))

    return dict(zip(requests, loop.run_until_complete(main())))


def _all_blocks_free(loop, engine: AsyncLLM) -> bool:
    """Every KV block is free (but the null block), once the core has handled the aborts."""

    async def main() -> bool:
        num_blocks = await engine.call_utility("get_num_kv_blocks")

        async def all_free() -> bool:
            return await engine.call_utility("get_num_free_blocks") == num_blocks - 1

        return await async_wait_until(all_free, 2)

    return loop.run_until_complete(main())


def test_requests_that_fail_in_the_core_fail_alone(loop, engine):
    good = {f"ok-{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    reference = {rid: out.outputs[0].token_ids for rid, out in _run(loop, engine, good).items()}
    undecodable = GREEDY.clone()
    undecodable.max_tokens = 1.5  # past validation: the core cannot decode this request
    poisoned = {
        "poison-add-0": (PROMPTS[0], GREEDY),
        "poison-step-0": (PROMPTS[1], GREEDY),
        "bad-decode": (PROMPTS[2], undecodable),
    }
    mixed = dict(list(good.items())[:2] + list(poisoned.items()) + list(good.items())[2:])
    outputs = _run(loop, engine, mixed)
    for rid in good:
        assert outputs[rid].outputs[0].token_ids == reference[rid]
        assert outputs[rid].outputs[0].finish_reason == "length"
    for rid, words in (("poison-add-0", "adding"), ("poison-step-0", "stepping")):
        assert isinstance(outputs[rid], ValueError), outputs[rid]
        assert f"injected fault {words} {rid}" in str(outputs[rid])
    assert isinstance(outputs["bad-decode"], ValueError)
    assert "SamplingParams.max_tokens" in str(outputs["bad-decode"])
    assert _all_blocks_free(loop, engine)
    assert not engine.errored


def test_a_request_whose_outputs_fail_on_the_caller_side_fails_alone(loop, engine, monkeypatch):
    update = OutputProcessor._update

    def faulty_update(self, state, out, now):
        if state.request_id == "poison-caller" and len(state.token_ids) >= 2:
            raise RuntimeError("injected fault in the output processor")
        return update(self, state, out, now)

    monkeypatch.setattr(OutputProcessor, "_update", faulty_update)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    requests = {"poison-caller": (PROMPTS[0], long), "fine": (PROMPTS[1], GREEDY)}
    outputs = _run(loop, engine, requests)
    assert "injected fault" in str(outputs["poison-caller"])
    assert len(outputs["fine"].outputs[0].token_ids) == GREEDY.max_tokens
    assert _all_blocks_free(loop, engine)  # the core was told to abort it


def test_a_fan_out_that_fails_half_way_leaves_nothing_behind(loop, engine, monkeypatch):
    sent = []
    add = engine.engine_core.add_request_async

    async def fail_second(request):
        if len(sent) == 1:
            raise OverflowError("injected: the second child cannot be sent")
        sent.append(request.request_id)
        await add(request)

    monkeypatch.setattr(engine.engine_core, "add_request_async", fail_second)
    fan = SamplingParams(n=3, max_tokens=50, ignore_eos=True)
    outputs = _run(loop, engine, {"fan": (PROMPTS[0], fan)})
    monkeypatch.undo()
    assert isinstance(outputs["fan"], OverflowError) and sent == ["0_fan"]
    assert engine.num_unfinished_requests == 0
    assert _all_blocks_free(loop, engine)  # the child that reached the core was aborted


def test_prompt_token_ids_of_a_wrong_type_are_a_value_error(loop, engine):
    """int() would have turned 2.5 into 2 and "15" into [1, 5], silently."""
    for ids in ([1, 2.5], [1, "5"], [1, True], "15", None):
        (error,) = _run(loop, engine, {"bad-ids": (ids, GREEDY)}).values()
        assert isinstance(error, ValueError) and "prompt_token_ids" in str(error), error
    assert not engine.errored and engine.num_unfinished_requests == 0


# ---- stop strings in DELTA streams through AsyncLLM -------------------------------------------


def test_async_delta_stream_never_carries_part_of_a_stop_string(tiny_chat_model, monkeypatch):
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")  # the caller side is what counts

    async def main() -> tuple[str, list[str], str]:
        engine = AsyncLLM.from_engine_args(_args(tiny_chat_model))
        try:
            prompt = {"prompt_token_ids": PROMPTS[3]}
            full = (await _consume(engine, prompt, SamplingParams(**_LONG_GREEDY), "full"))[-1]
            text = full.outputs[0].text
            half = len(text) // 2  # a stop string from the middle, first seen there
            pieces = (text[i : i + 6] for i in range(half, len(text)))
            stop = next(s for s in pieces if text.find(s) >= half)
            params = SamplingParams(
                **_LONG_GREEDY, stop=[stop], output_kind=RequestOutputKind.DELTA
            )
            deltas = await _consume(engine, prompt, params, "streamed")
            return text, [d.outputs[0].text for d in deltas], stop
        finally:
            engine.shutdown()

    text, deltas, stop = asyncio.run(main())
    assert "".join(deltas) == text[: text.index(stop)]
    assert len([d for d in deltas if d]) > 3  # streamed in pieces


_LONG_GREEDY = dict(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_msgspec_round_trip_of_every_validated_request():
    """What SamplingParams accepts, the core's decoder accepts (a wrong type used to kill the
    core's input thread)."""
    from pagellm.protocol import EngineCoreRequest

    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    params = SamplingParams(n=3, seed=2**63 - 1, top_k=2**31 - 1, logit_bias={"5": 100})
    request = EngineCoreRequest("r", [1, 2], params, [2], 0.0)
    assert decoder.decode(msgspec.msgpack.encode(request)) == request
    children = [child for child, _, _ in fan_out(request)]  # seeds seed + i stay in int64
    assert [child.sampling_params.seed for child in children] == [2**63 - 1, -(2**63), -(2**63) + 1]
    for child in children:
        assert decoder.decode(msgspec.msgpack.encode(child)) == child


@pytest.mark.parametrize("killed", [False, True])
def test_an_exited_core_gets_time_for_its_death_report(killed, monkeypatch, tmp_path):
    """The core reports its error just before it exits; the reader may see the exit before
    the report arrives. A core that exited itself gets _REPORT_S from the first sighting of
    the exit (so the caller hears "EngineCore died: <reason>"); one killed by a signal sends
    nothing and is dead at once. While a frame waits unread in the output socket (the
    sender's and the reader's checks may come in a row) no verdict comes either."""
    import subprocess
    import sys

    import zmq

    client = object.__new__(core_client.SyncMPClient)  # the liveness state and one socket
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    client.proc = subprocess.Popen([sys.executable, "-c", suicide if killed else "exit(3)"])
    client.proc.wait()
    client.ipc_dir, client.dead_error, client._exit_seen = str(tmp_path), None, None  # no file
    ctx = zmq.Context()
    client.output_socket = ctx.socket(zmq.PULL)
    client.output_socket.bind("inproc://death-report")
    core_side = ctx.socket(zmq.PUSH)
    core_side.connect("inproc://death-report")
    monkeypatch.setattr(core_client, "_REPORT_S", 60.0)
    try:
        if not killed:
            client._check_alive()  # first sighting: no verdict yet
        core_side.send_multipart([b"0", b"the last words"])
        client._check_alive()  # a frame to read first: no verdict either
        assert client.output_socket.recv_multipart() == [b"0", b"the last words"]
        if not killed:
            client._check_alive()  # within _REPORT_S: still none
            monkeypatch.setattr(core_client, "_REPORT_S", 0.0)
        code = -signal.SIGKILL if killed else 3
        with pytest.raises(EngineDeadError, match=rf"exited unexpectedly \(code {code}\)"):
            client._check_alive()
        with pytest.raises(EngineDeadError):  # and it stays dead
            client._check_alive()
    finally:
        core_side.close(linger=0)
        client.output_socket.close(linger=0)
        ctx.term()


def test_an_exited_core_is_judged_by_the_report_it_left(tmp_path):
    """A core that died of an error wrote its reason beside the sockets before it exited: the
    client names it as soon as it sees the exit, not after waiting for the socket's copy (on a
    loaded machine that copy once lost the race, and the error said only "exited
    unexpectedly"). Without a report the verdict waits for the socket (_REPORT_S)."""
    import subprocess
    import sys

    from pagellm.engine.core_proc import write_death_report
    from pagellm.engine.core_process import DEATH_REPORT

    client = object.__new__(core_client.SyncMPClient)
    client.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    client.proc.wait()
    client.ipc_dir, client.dead_error, client._exit_seen = str(tmp_path), None, None
    client._check_alive()  # exited, no report yet: the socket's copy gets its time
    assert client.dead_error is None
    write_death_report(str(tmp_path / DEATH_REPORT), msgspec.msgpack.encode(["X", "boom"]))
    with pytest.raises(EngineDeadError, match="EngineCore died: boom"):
        client._check_alive()
    assert not (tmp_path / (DEATH_REPORT + ".tmp")).exists()
