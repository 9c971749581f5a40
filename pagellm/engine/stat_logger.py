"""StatLogger: vLLM's periodic stats line, on the caller side, from the EngineCore's counters.

Every EngineCoreOutputs carries the core's SchedulerStats (running, waiting, KV usage, and
counters since start); `record()` takes each one and, once `interval_s` has passed since the
last line, logs the throughputs over that interval and the prefix-cache hit rate since start.
"""

from __future__ import annotations

import logging
import time

from pagellm.protocol import SchedulerStats

logger = logging.getLogger(__name__)


class StatLogger:
    __slots__ = ("interval_s", "device", "last_time", "last")

    def __init__(self, interval_s: float, device: str = "cpu") -> None:
        self.interval_s = interval_s
        self.device = "GPU" if device.startswith("cuda") else "CPU"
        self.last_time = time.monotonic()
        self.last = SchedulerStats()  # the counters at the last line

    def record(self, stats: SchedulerStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.last_time >= self.interval_s:
            logger.info(self.line(stats, now - self.last_time))
            spec = self.spec_line(stats)
            if spec:
                logger.info(spec)
            self.last_time, self.last = now, stats

    def line(self, stats: SchedulerStats, elapsed_s: float) -> str:
        last, elapsed_s = self.last, max(elapsed_s, 1e-9)
        prompt = (stats.num_prompt_tokens - last.num_prompt_tokens) / elapsed_s
        generation = (stats.num_generation_tokens - last.num_generation_tokens) / elapsed_s
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        return (
            f"Avg prompt throughput: {prompt:.1f} tokens/s, "
            f"Avg generation throughput: {generation:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"{self.device} KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
            f"Preemptions: {stats.num_preemptions - last.num_preemptions}"
        )

    def spec_line(self, stats: SchedulerStats) -> str | None:
        """vLLM's speculative-decoding line over the interval; None without drafts in it."""
        last = self.last
        drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
        if drafts <= 0:
            return None
        drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
        before = last.spec_decode_num_accepted_tokens_per_pos
        per_pos = [
            (n - (before[i] if i < len(before) else 0)) / drafts
            for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)
        ]
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
            f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
        )
