"""Tensor parallelism through Ray (RayDistributedExecutor): one actor per rank in a
placement group of {"CPU": 1} bundles, on a local Ray head this module starts
(`ray_utils.start_ray_head`: one that a loaded machine does not time out).

Qwen3 with one KV head over 2 ranks (each holds a copy), async scheduling, chunked prefill,
prefix-cache hits and preemptions: the same greedy tokens as one rank. Then an actor is
killed mid-generation: EngineDeadError at once, and no actor process is left.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from model_utils import make_tiny_hf_model
from ray_utils import local_ray_head
from test_tensor_parallel import (
    GREEDY,
    SMALL_KV,
    STRESS,
    TOKEN_PROMPTS,
    _alive,
    _one_rank_reference,
    _token_ids,
)
from timing import scaled, slowdown, wait_until

from pagellm import LLM, SamplingParams
from pagellm.engine.core_client import EngineDeadError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_head(num_cpus=2) as head:
        ray.init(address=head.address, logging_level="WARNING")
        try:
            yield
        finally:
            ray.shutdown()


def test_ray_ranks_same_tokens_then_a_dead_actor(ray_cluster, tmp_path, monkeypatch):
    folder = make_tiny_hf_model("qwen3", tmp_path, num_key_value_heads=1)
    want = _one_rank_reference(folder, monkeypatch)
    kwargs = dict(max_model_len=256, kv_cache_memory_bytes=SMALL_KV, async_scheduling=True)
    # no backend named: a caller connected to Ray gets the Ray executor
    llm = LLM(dtype="float32", model=folder, tensor_parallel_size=2, **kwargs, **STRESS)
    try:
        assert _token_ids(llm, TOKEN_PROMPTS) == want
        assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
        ranks = llm.llm_engine.call_utility("collective_rpc", "describe", [])
        pids = [r["pid"] for r in ranks]
        assert len(set(pids)) == 2 and llm.llm_engine.engine_core.proc.pid not in pids

        load = slowdown()
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)

        threading.Timer(1.0, kill).start()
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="Ray actor"):
            llm.generate([{"prompt_token_ids": p} for p in TOKEN_PROMPTS * 4], long)
        assert killed_at and time.monotonic() - killed_at[0] < scaled(5.0, load)
        with pytest.raises(EngineDeadError):
            llm.generate({"prompt_token_ids": TOKEN_PROMPTS[0]}, GREEDY)
    finally:
        llm.shutdown()
    wait_until(lambda: not any(_alive(pid) for pid in pids), 10, interval=0.1)
    assert not [pid for pid in pids if _alive(pid)], "actor processes left behind"
