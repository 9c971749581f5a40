"""The periodic stats line: its numbers from the EngineCore's counters, during LLM.generate."""

from __future__ import annotations

import logging

import pytest
from conftest import PROMPTS

from pagellm import SamplingParams
from pagellm.engine.stat_logger import StatLogger
from pagellm.protocol import SchedulerStats


def test_line_reports_the_interval_throughputs():
    stat_logger = StatLogger(interval_s=10.0, device="cuda:0")
    stat_logger.last = SchedulerStats(
        num_prompt_tokens=1000, num_generation_tokens=50, prefix_cache_queries=64,
        prefix_cache_hits=64, num_preemptions=1,
    )  # fmt: skip
    now = SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.125, num_preemptions=3,
        prefix_cache_queries=164, prefix_cache_hits=89, num_prompt_tokens=1200,
        num_generation_tokens=250,
    )  # fmt: skip
    assert stat_logger.line(now, elapsed_s=4.0) == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 12.5%, "
        "Prefix cache hit rate: 54.3%, Preemptions: 2"
    )


def test_record_logs_once_per_interval(caplog):
    stat_logger = StatLogger(interval_s=10.0)
    start = stat_logger.last_time
    with caplog.at_level(logging.INFO, logger="pagellm.engine.stat_logger"):
        stat_logger.record(SchedulerStats(num_generation_tokens=5), now=start + 5)
        stat_logger.record(SchedulerStats(num_generation_tokens=30), now=start + 10)
        stat_logger.record(SchedulerStats(num_generation_tokens=40), now=start + 15)
    assert [r.getMessage().split(", ")[1] for r in caplog.records] == [
        "Avg generation throughput: 3.0 tokens/s"
    ]


@pytest.fixture
def logging_every_step(llm):
    stat_logger = llm.llm_engine.stat_logger
    stat_logger.interval_s = 0.0
    yield llm
    stat_logger.interval_s = 10.0


def test_stats_line_during_generate_counts_the_tokens(logging_every_step, caplog):
    llm = logging_every_step
    llm.reset_prefix_cache()
    prompts = [f"{p} (stats)" for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    before = llm.llm_engine.call_utility("get_stats")
    with caplog.at_level(logging.INFO, logger="pagellm.engine.stat_logger"):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.llm_engine.call_utility("get_stats")
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert len(lines) >= 4 and any("Running: 3 reqs" in line for line in lines)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == num_prompt
    assert after["num_generation_tokens"] - before["num_generation_tokens"] == 3 * 5
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
