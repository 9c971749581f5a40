"""The request-journey trace: every boundary a request crosses, in both processes, one clock.

`LLM(trace="journey.json")` (or `pagellm generate --trace`, `pagellm serve --trace-dir`)
records Chrome-trace events (open the file at ui.perfetto.dev): per process a "steps" track
(one slice per schedule / execute_model / update_from_output) and one track per request.

Free when off: each boundary reports itself by an explicit call, behind one test of the
engine's tracer (None when off): the caller's (`CallerTracer`: LLMEngine or AsyncLLM, and
their OutputProcessor) and the EngineCore's (`CoreTracer`: its input thread, `add_request`,
and the scheduler and executor calls of its steps). Both processes stamp events with
CLOCK_MONOTONIC (system-wide on one machine); the core's events ride back to the caller in
`EngineCoreOutputs.trace_events`, and the caller writes one file at shutdown.

A request's boundaries, in order (process: event name):
caller: input_processing -> caller: zmq_send -> core: input_queue -> core: add_request ->
core: schedule -> core: execute_model -> core: update_from_output -> core: zmq_return ->
caller: output_received -> caller: detokenize -> caller: stop_check -> caller: request_output
(schedule .. stop_check repeat per step; `preempted` marks a preemption). With speculative
decoding a step's `schedule` counts the drafts it verifies (`num_draft_tokens`), its
`update_from_output` the accepted ones too (`num_accepted_tokens`), and the finished
`request_output` the request's totals.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

STEPS_TID = 0  # each process's track of whole steps; requests get tids 1, 2, ...


def now_us() -> float:
    """CLOCK_MONOTONIC in microseconds (Chrome trace's unit), the same in every process."""
    return time.monotonic_ns() / 1000


class Tracer:
    """One process's trace events, as Chrome-trace dicts. Thread-safe: the core's input
    socket thread stamps arrivals while the loop drains events into a step's outputs."""

    def __init__(self, process_name: str) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = []
        self.tids: dict[str, int] = {}
        self._meta("process_name", STEPS_TID, process_name)
        self._meta("thread_name", STEPS_TID, "steps")

    def _meta(self, name: str, tid: int, value: str) -> None:
        self.events.append(
            {"name": name, "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": value}}
        )

    def tid(self, request_id: str | None) -> int:
        if request_id is None:
            return STEPS_TID
        tid = self.tids.get(request_id)
        if tid is None:
            tid = self.tids[request_id] = len(self.tids) + 1
            self._meta("thread_name", tid, f"request {request_id}")
        return tid

    def span(self, name: str, start_us: float, request_id: str | None = None, **args: Any):
        """A slice from `start_us` to now on the request's track (or the steps track)."""
        return self._add(name, "X", start_us, request_id, args, dur=now_us() - start_us)

    def instant(self, name: str, request_id: str | None = None, **args: Any) -> None:
        self._add(name, "i", now_us(), request_id, args)

    def _add(self, name, ph, ts, request_id, args, **extra) -> dict[str, Any]:
        if request_id is not None:
            args["request_id"] = request_id
        with self.lock:
            tid = self.tid(request_id)
            event = {"name": name, "ph": ph, "ts": ts, "pid": self.pid, "tid": tid}
            if ph == "i":
                event["s"] = "t"  # an instant on its own track
            event = {**event, **extra, "args": args}
            self.events.append(event)
        return event

    def drain(self) -> list[dict[str, Any]]:
        with self.lock:
            events, self.events = self.events, []
        return events

    def write(self, path: str) -> None:
        events = sorted(self.events, key=lambda e: e.get("ts", -1.0))
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


# ---- the caller's side ---------------------------------------------------------------------


class CallerTracer(Tracer):
    """The caller's boundaries (LLMEngine or AsyncLLM, OutputProcessor), each reported by an
    explicit call at the boundary: `if tracer is not None: tracer.<boundary>(...)`."""

    def __init__(self) -> None:
        super().__init__("caller (LLMEngine, OutputProcessor)")

    def input_processing(self, start_us: float, request: Any) -> None:
        num_prompt_tokens = len(request.prompt_token_ids)
        self.span(
            "input_processing", start_us, request.request_id, num_prompt_tokens=num_prompt_tokens
        )

    def zmq_send(self, start_us: float, request_id: str) -> None:
        self.span("zmq_send", start_us, request_id)

    def output_received(self, outputs: Any) -> None:
        """The ZMQ return's arrival: the core's events join the caller's."""
        if outputs.trace_events:
            self.events.extend(outputs.trace_events)
            outputs.trace_events = None
        for out in outputs.outputs:
            self.instant("output_received", out.request_id, num_new_tokens=len(out.new_token_ids))

    def detokenize(self, start_us: float, request_id: str, num_tokens: int, stop_string: Any):
        self.span("detokenize", start_us, request_id, num_tokens=num_tokens)
        self.instant("stop_check", request_id, stop_string=stop_string)

    def request_output(
        self, request_id: str, finished: bool, output: Any, metrics: Any = None
    ) -> None:
        """A RequestOutput made (or held back: n > 1); once finished, the request's drafts
        and accepted drafts over all its steps (`RequestMetrics`), where it had drafts."""
        args = dict(finished=finished, made=output is not None)
        if finished and metrics is not None and metrics.num_draft_tokens:
            args.update(_spec_counts(metrics))
        self.instant("request_output", request_id, **args)


# ---- the EngineCore's side -----------------------------------------------------------------


class CoreTracer(Tracer):
    """The boundaries of an EngineCore's steps, reported by the EngineCore where it calls the
    scheduler and the executor. The runner's paging (`trace_kv`: a request id whose block
    table row and slot mapping the runner dumps at each of its steps) and CUDA times where the
    runner is in this process (UniProcExecutor; with worker processes the mode reads
    "workers")."""

    def __init__(self, executor: Any, trace_kv: str | None = None) -> None:
        super().__init__("EngineCore (Scheduler, ModelRunner)")
        self.runner = getattr(executor, "model_runner", None)
        self.cuda = self.runner is not None and self.runner.device.type == "cuda"
        self.pending: list[tuple[Any, Any, dict]] = []  # CUDA events not yet complete, with args
        if trace_kv is not None and self.runner is not None:
            self.runner.trace_paging = functools.partial(_dump_kv, self, self.runner, trace_kv)

    def input_queue(self, request_id: str) -> None:
        """A new request, as the input socket's thread puts it on the core's queue."""
        self.instant("input_queue", request_id)

    def add_request(self, start_us: float, request_id: str) -> None:
        self.span("add_request", start_us, request_id)

    def schedule(self, start_us: float, scheduler: Any, sched: Any) -> None:
        preempted = [r for r in sched.finished_req_ids if r in scheduler.requests]
        drafts = sum(map(len, sched.scheduled_spec_decode_tokens.values()))
        self.span("schedule", start_us, None, num_reqs=len(sched.num_scheduled_tokens),
                  num_tokens=sched.total_num_scheduled_tokens, preempted=preempted,
                  **({"num_draft_tokens": drafts} if drafts else {}))  # fmt: skip
        for request_id in preempted:
            self.instant("preempted", request_id)
        _scheduled_requests(self, scheduler, sched, start_us)

    def execute_start(self) -> tuple[float, Any]:
        """The start of an executor call: (now, CUDA events or None)."""
        return now_us(), _cuda_events() if self.cuda else None

    def execute_model(self, start: tuple[float, Any], sched: Any) -> None:
        start_us, events = start
        if events is not None:
            events[1].record()
        mode = _mode(self.runner, sched)
        step_args = dict(batch_size=len(sched.num_scheduled_tokens), mode=mode,
                         num_tokens=sched.total_num_scheduled_tokens)  # fmt: skip
        step = self.span("execute_model", start_us, None, **step_args)
        for request_id, n in sched.num_scheduled_tokens.items():
            self.span("execute_model", start_us, request_id, num_tokens=n, mode=mode)
        if events is not None:
            self.pending.append((*events, step["args"]))
        _resolve_gpu_times(self.pending)

    def update_from_output(self, start_us: float, outputs: Any) -> None:
        """The step's outputs; those with requests in them (only they are sent) carry this
        process's events back to the caller."""
        self.span("update_from_output", start_us, None, num_outputs=len(outputs.outputs))
        for out in outputs.outputs:
            spec = _spec_counts(out) if out.num_draft_tokens else {}
            self.span("update_from_output", start_us, out.request_id,
                      new_token_ids=out.new_token_ids, finished=out.finished, **spec)  # fmt: skip
        if outputs.outputs:
            for out in outputs.outputs:
                self.instant("zmq_return", out.request_id)
            outputs.trace_events = self.drain()


def _spec_counts(counts: Any) -> dict[str, int]:
    """Drafts verified and accepted: a step's (`EngineCoreOutput`) or a request's totals
    (`RequestMetrics`)."""
    return dict(num_draft_tokens=counts.num_draft_tokens,
                num_accepted_tokens=counts.num_accepted_tokens)  # fmt: skip


def _scheduled_requests(tracer: Tracer, scheduler: Any, sched: Any, start: float) -> None:
    new = {r.req_id: r for r in sched.scheduled_new_reqs}
    cached = sched.scheduled_cached_reqs
    new_blocks = dict(zip(cached.req_ids, cached.new_block_ids))
    computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
    kv = scheduler.kv_cache_manager
    for request_id, num_tokens in sched.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request_id in new:
            num_computed, added = new[request_id].num_computed_tokens, new[request_id].block_ids
        else:
            num_computed, added = computed[request_id], new_blocks[request_id]
        prefill = num_computed < request.num_prompt_tokens
        kind = "decode" if not prefill else "prefill"
        if prefill and num_computed + num_tokens < request.num_prompt_tokens:
            kind = "prefill chunk"
        drafts = len(sched.scheduled_spec_decode_tokens.get(request_id, ()))
        tracer.span("schedule", start, request_id, num_tokens=num_tokens, kind=kind,
                    num_computed_tokens=num_computed, new_block_ids=list(added),
                    block_ids=list(kv.get_block_ids(request_id)),
                    prefix_cache_hit_tokens=num_computed if request_id in new else 0,
                    **({"num_draft_tokens": drafts} if drafts else {}))  # fmt: skip


def _mode(runner: Any, sched: Any) -> str:
    if runner is None:
        return "workers"
    decode_only = sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens)
    graphs, num_reqs = runner.graphs, len(sched.num_scheduled_tokens)
    replayed = graphs is not None and decode_only and graphs.size_for(num_reqs) is not None
    return "cuda_graph" if replayed else "eager"


def _cuda_events() -> tuple[Any, Any]:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _resolve_gpu_times(pending: list) -> None:
    """Fill in the GPU time of finished steps, without waiting for any (no sync is added)."""
    while pending and pending[0][1].query():
        start, end, args = pending.pop(0)
        args["gpu_ms"] = start.elapsed_time(end)


def _dump_kv(tracer: Tracer, runner: Any, request_id: str, batch: Any, arrays: dict) -> None:
    """The paging of one request in this step: its block table row and slot mapping."""
    if request_id in batch.req_ids:
        i = batch.req_ids.index(request_id)
        lo, hi = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        num_blocks = -(-int(batch.seq_lens[i]) // runner.block_size)
        row = runner.input_batch.block_table[batch.rows[i], :num_blocks]
        tracer.instant("kv_paging", request_id, block_size=runner.block_size,
                       block_table=row.tolist(), positions=batch.positions[lo:hi].tolist(),
                       slot_mapping=arrays["slot_mapping"][lo:hi].tolist())  # fmt: skip


# ---- reading a trace -----------------------------------------------------------------------

# what each boundary is, in the walkthrough's words
_BOUNDARIES = {
    "input_processing": "InputProcessor: tokenize and validate -> EngineCoreRequest",
    "zmq_send": "EngineCoreClient.add_request: msgpack over ZMQ to the EngineCore",
    "input_queue": "EngineCore input socket thread: decoded, on the input queue",
    "add_request": "EngineCore.add_request: the Scheduler's waiting queue",
    "schedule": "Scheduler.schedule: tokens and KV blocks for this step",
    "preempted": "Scheduler: preempted (blocks freed, back to waiting)",
    "kv_paging": "ModelRunner: block table row and slot mapping of this step",
    "execute_model": "ModelRunner.execute_model: forward over the paged KV cache, sample",
    "update_from_output": "Scheduler.update_from_output: append tokens, check stops",
    "zmq_return": "EngineCoreOutputs onto the output socket",
    "output_received": "EngineCoreClient.get_output: EngineCoreOutputs arrived",
    "detokenize": "OutputProcessor: incremental detokenization",
    "stop_check": "OutputProcessor: stop strings",
    "request_output": "OutputProcessor: RequestOutput",
}
_SHOWN_ARGS = ("kind", "num_tokens", "num_computed_tokens", "new_block_ids", "block_ids",
               "prefix_cache_hit_tokens", "mode", "gpu_ms", "new_token_ids", "finished",
               "stop_string", "num_prompt_tokens", "num_draft_tokens", "num_accepted_tokens",
               "block_table", "positions", "slot_mapping")  # fmt: skip


def load_events(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def request_events(events: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """One request's boundaries in time order."""
    mine = [e for e in events if e.get("args", {}).get("request_id") == request_id]
    return sorted(mine, key=lambda e: e["ts"])


def summarize(path: str, request_id: str | None = None) -> str:
    """A text walkthrough of one request (default: the first): each boundary, in which
    process, the time since the previous one, and what it did."""
    events = load_events(path)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    ids = [e["args"]["request_id"] for e in events if "request_id" in e.get("args", {})]
    if not ids:
        raise ValueError(f"{path} has no request events")
    request_id = ids[0] if request_id is None else request_id
    mine = request_events(events, request_id)
    if not mine:
        raise ValueError(f"request {request_id!r} is not in {path} (it has {sorted(set(ids))})")
    lines = [f"request {request_id}: {len(mine)} boundaries over "
             f"{(mine[-1]['ts'] - mine[0]['ts']) / 1000:.3f} ms"]  # fmt: skip
    previous = mine[0]["ts"]
    for e in mine:
        lines += _walkthrough_lines(e, e["ts"] - previous, processes)
        previous = e["ts"]
    return "\n".join(lines)


def _walkthrough_lines(e: dict[str, Any], since_us: float, processes: dict) -> list[str]:
    process = processes.get(e["pid"], str(e["pid"])).split(" ")[0]
    took = f" ({e['dur'] / 1000:.3f} ms)" if "dur" in e else ""
    what = _BOUNDARIES.get(e["name"], "")
    lines = [f"+{since_us / 1000:8.3f} ms  [{process:10}] {e['name']}{took}: {what}"]
    args = ", ".join(f"{k}={e['args'][k]}" for k in _SHOWN_ARGS if k in e["args"])
    return lines + [f"{'':26}{args}"] if args else lines
