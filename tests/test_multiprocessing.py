"""The process boundary: same outputs in every mode, dying cores, aborts, clean exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
from conftest import PROMPTS
from timing import async_wait_until, scaled, slowdown, wait_until

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.attention.selector import get_attn_backend_cls
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.core_client import EngineDeadError, SyncMPClient
from pagellm.loader import load_model
from pagellm.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DEATH_DEADLINE_S = 1.0  # the README: waiting callers hear of a dead core within a second
# (on an idle machine: `timing.scaled` allows for the load measured in the test)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    return wait_until(lambda: not _alive(pid), timeout)


def _core_pid(llm: LLM) -> int:
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    return client.proc.pid


def test_same_tokens_in_process_and_multiprocess(llm, monkeypatch):
    mp_out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    with LLM(dtype="float32", max_model_len=1024) as inproc:
        assert not hasattr(inproc.llm_engine.engine_core, "proc")
        in_out = [o.outputs[0].token_ids for o in inproc.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert mp_out == in_out


def test_idle_core_does_not_spin(llm):
    pid = _core_pid(llm)

    def cpu_seconds() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu_seconds()
    time.sleep(scaled(1.0))  # a spinning core gets ~1 s of CPU in it, however busy the machine
    assert cpu_seconds() - before < 0.1


def test_killed_core_raises_engine_dead_error_quickly():
    llm = LLM(dtype="float32", max_model_len=512)
    load = slowdown()  # the machine's, before the engine's own work
    pid = _core_pid(llm)
    ipc_dir = llm.llm_engine.engine_core.ipc_dir
    killed_at = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS * 8, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed_at[0] < scaled(DEATH_DEADLINE_S, load)
    with pytest.raises(EngineDeadError):  # and stays dead
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _wait_gone(pid)
    assert not os.path.exists(ipc_dir)


def test_request_to_a_dead_idle_core_fails_fast():
    llm = LLM(dtype="float32", max_model_len=256)
    os.kill(_core_pid(llm), signal.SIGKILL)
    time.sleep(0.5)
    load = slowdown()
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < scaled(DEATH_DEADLINE_S, load)
    llm.shutdown()


def test_async_iterators_all_raise_when_core_dies():
    async def main() -> list[BaseException]:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=512))
        params = SamplingParams(max_tokens=400, ignore_eos=True)

        async def consume(i: int) -> None:
            async for _ in engine.generate(PROMPTS[i % len(PROMPTS)], params, f"req-{i}"):
                pass

        idle = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=256))
        assert not idle.errored
        os.kill(idle.engine_core.proc.pid, signal.SIGKILL)
        # noticed with nothing running, no request needed
        assert await async_wait_until(lambda: idle.errored, 0.5)
        idle.shutdown()

        load = slowdown()  # before this engine's work
        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        await asyncio.sleep(1.5)
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), scaled(DEATH_DEADLINE_S, load)
        )
        engine.shutdown()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_concurrent_async_requests_and_abort_frees_blocks(llm, async_scheduling):
    prompts = [f"{p} (variant {i})" for i, p in enumerate(PROMPTS * 9)][:72]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    args = EngineArgs(dtype="float32", max_model_len=1024, async_scheduling=async_scheduling)

    async def main():
        engine = AsyncLLM.from_engine_args(args)
        total = await engine.call_utility("get_num_free_blocks")

        async def run(i: int) -> list[int]:
            params = GREEDY.clone()
            params.output_kind = RequestOutputKind.DELTA
            tokens: list[int] = []
            async for out in engine.generate(prompts[i], params, f"r{i}"):
                tokens += out.outputs[0].token_ids
            return tokens

        got = await asyncio.gather(*(run(i) for i in range(len(prompts))))

        long = SamplingParams(max_tokens=500, ignore_eos=True)
        agen = engine.generate(PROMPTS[0], long, "to-abort")
        await agen.__anext__()
        used = await engine.call_utility("get_num_free_blocks")
        await agen.aclose()  # the caller walks away: the request is aborted in the core

        async def all_free() -> bool:
            return await engine.call_utility("get_num_free_blocks") == total

        freed = await async_wait_until(all_free, 0.2)
        engine.shutdown()
        return got, total, used, freed

    got, total, used, freed = asyncio.run(main())
    assert got == expected
    assert used < total and freed


def test_bad_weights_fail_fast_with_the_childs_message(tmp_path):
    from model_utils import make_tiny_hf_model

    folder = make_tiny_hf_model("llama", tmp_path)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"this is not a safetensors file")
    load = slowdown()
    start = time.monotonic()
    with pytest.raises(Exception, match="EngineCore failed to start") as info:
        LLM(model=folder)
    assert time.monotonic() - start < scaled(30, load)
    assert "safetensors" in str(info.value).lower() or "header" in str(info.value).lower()


def test_bad_model_path_is_a_clear_error():
    with pytest.raises(ValueError, match="no/such/model"):
        LLM(model="/no/such/model")


CHILD_SCRIPT = """
import json, sys
from pagellm import LLM
llm = LLM(max_model_len=256)
client = llm.llm_engine.engine_core
print(json.dumps({"pid": client.proc.pid, "ipc_dir": client.ipc_dir}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_orphan_when_parent_is_killed(sig):
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    info = json.loads(parent.stdout.readline())
    assert _alive(info["pid"])
    parent.send_signal(sig)
    parent.wait(timeout=scaled(10))
    assert _wait_gone(info["pid"], timeout=5)
    assert not os.path.exists(info["ipc_dir"])


def test_interpreter_exit_stops_the_core():
    script = CHILD_SCRIPT.replace("sys.stdin.read()", "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    info = json.loads(out.stdout.decode().splitlines()[-1])
    assert _wait_gone(info["pid"], timeout=2)
    assert not os.path.exists(info["ipc_dir"])


_STACKS_SCRIPT = r"""
import os, signal, time
from pagellm import LLM, SamplingParams
llm = LLM(dtype="float32", max_model_len=256)
# one request first: once it is answered the core's main thread is in its busy loop (READY can
# reach us while that thread is still starting the output thread)
llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
pid = llm.llm_engine.engine_core.proc.pid
os.kill(pid, signal.SIGUSR1)
time.sleep(1.0)
out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
llm.shutdown()
"""


def test_sigusr1_prints_the_cores_stacks_and_it_carries_on():
    """`kill -USR1 <core pid>`: every thread's Python stack on stderr, the core unharmed."""
    out = subprocess.run(
        [sys.executable, "-c", _STACKS_SCRIPT], capture_output=True, timeout=scaled(120)
    )
    stderr = out.stderr.decode()
    assert out.returncode == 0, stderr[-2000:]
    assert out.stdout.decode().split()[-1] == "4"  # the request after the signal ran
    assert "run_busy_loop" in stderr and "(most recent call first)" in stderr, stderr[-2000:]


_CORE_SIDE = r"""
import sys
import msgspec
import pagellm.engine.core_proc  # everything the EngineCore process imports
from pagellm.attention.selector import get_attn_backend_cls
from pagellm.config import EngineConfig
from pagellm.loader import load_model
config = EngineConfig.from_wire(msgspec.msgpack.decode(sys.stdin.buffer.read()))
mc = config.model_config
model = load_model(mc, "cpu", get_attn_backend_cls("cpu"))
print(mc.head_dim, mc.num_kv_heads, mc.dtype, sum(p.numel() for p in model.parameters()))
print("transformers" in sys.modules, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("model", [None, "tiny-qwen3"])
def test_core_process_builds_from_the_wire_config_without_transformers(model, tmp_path):
    """The EngineCore process gets its config as plain data and builds the model from it
    without importing transformers or torch._dynamo (seconds each at start-up)."""
    from model_utils import make_tiny_hf_model

    args = EngineArgs(dtype="float32", device="cpu")  # the embedded GGUF model
    if model is not None:
        args = EngineArgs(model=make_tiny_hf_model("qwen3", tmp_path), device="cpu")
    config = args.create_engine_config()
    mc = config.model_config
    wire = msgspec.msgpack.encode(config.to_wire())
    out = subprocess.run(
        [sys.executable, "-c", _CORE_SIDE], input=wire, capture_output=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    shape_line, imports_line = out.stdout.decode().splitlines()[-2:]
    expected = load_model(mc, "cpu", get_attn_backend_cls("cpu"))  # here, from the real config
    numel = sum(p.numel() for p in expected.parameters())
    assert shape_line == f"{mc.head_dim} {mc.num_kv_heads} {mc.dtype} {numel}"
    assert imports_line == "False False"


# ---- the spare core (pagellm serve --restart-engine) ------------------------------------------


@pytest.mark.parametrize("mode", ["loaded", "imported"])
def test_restart_hands_over_to_the_spare_and_does_without_a_lost_one(
    tiny_chat_model, mode, monkeypatch
):
    """restart_engine_core() takes the spare (loading it first if it only imported), which
    serves the same greedy tokens with the first core's CPU GEMM plan, then starts the next
    spare SPARE_DELAY_S later; a spare that died is replaced by a new process. Shutdown stops
    every core, the spare too, and removes their IPC files."""
    from pagellm.engine import async_llm

    monkeypatch.setattr(async_llm, "SPARE_DELAY_S", 0.5)

    async def greedy(engine: AsyncLLM, request_id: str) -> list[int]:
        params = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        (out,) = [out async for out in engine.generate(PROMPTS[0], params, request_id)]
        return out.outputs[0].token_ids

    async def kill_and_restart(engine: AsyncLLM) -> None:
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        await asyncio.wait_for(engine.wait_dead(), DEATH_DEADLINE_S)
        await engine.restart_engine_core()

    async def main() -> list:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_chat_model, max_model_len=256))
        engine.keep_spare(mode)
        first, plan = await greedy(engine, "a"), engine.engine_core.ready.cpu_gemm_plan
        spare = engine.spare.client
        if mode == "loaded":
            await engine.spare.ready
        await kill_and_restart(engine)
        assert engine.engine_core is spare and engine.engine_core.ready.cpu_gemm_plan == plan
        assert engine.spare is None  # not yet
        assert await greedy(engine, "b") == first
        await asyncio.sleep(1.0)
        lost = engine.spare.client
        os.kill(lost.proc.pid, signal.SIGKILL)  # while it loads, or waits for its config
        await kill_and_restart(engine)
        assert engine.engine_core not in (spare, lost) and await greedy(engine, "c") == first
        await asyncio.sleep(1.0)
        clients = [spare, lost, engine.engine_core, engine.spare.client]
        engine.shutdown()
        return [(c.proc.pid, c.ipc_dir) for c in clients]

    for pid, ipc_dir in asyncio.run(main()):
        assert _wait_gone(pid, timeout=5) and not os.path.exists(ipc_dir)


_SPARE_SCRIPT = r"""
import asyncio, json, sys
from pagellm import EngineArgs
from pagellm.engine.async_llm import AsyncLLM

async def main():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], max_model_len=256))
    engine.keep_spare(sys.argv[2])
    if engine.spare.ready is not None:
        await engine.spare.ready
    clients = [engine.engine_core, engine.spare.client]
    print(json.dumps([[c.proc.pid, c.ipc_dir] for c in clients]), flush=True)
    await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "spare, sig",
    [("loaded", signal.SIGKILL), ("loaded", signal.SIGTERM), ("imported", signal.SIGKILL)],
)
def test_no_orphan_spare_when_parent_is_killed(tiny_chat_model, spare, sig):
    """A loaded spare's parent watchdog, or an imported one's stdin at EOF (read once its
    imports are done), ends it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _SPARE_SCRIPT, tiny_chat_model, spare],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # the cores' too
    )
    log: list[bytes] = []
    threading.Thread(target=lambda: log.extend(parent.stderr), daemon=True).start()
    cores = json.loads(parent.stdout.readline())
    assert all(_alive(pid) for pid, _ in cores)
    imported = f"EngineCore process {cores[1][0]}: imports done".encode()
    deadline = time.monotonic() + 120
    while not any(imported in line for line in log):
        assert time.monotonic() < deadline, b"".join(log)[-2000:]
        time.sleep(0.1)
    parent.send_signal(sig)
    parent.wait(timeout=10)
    for pid, ipc_dir in cores:
        assert _wait_gone(pid, timeout=5) and not os.path.exists(ipc_dir)
