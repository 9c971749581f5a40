"""The request-journey trace: 8 requests on the embedded model, both processes, one clock."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from conftest import PROMPTS

from pagellm import LLM, SamplingParams
from pagellm.cli import main as cli_main
from pagellm.tracing import load_events, request_events

MAX_TOKENS = 4
BLOCK = 16
CHUNK = 32  # max_num_batched_tokens: the long prompt is prefilled in chunks
LONG = PROMPTS[2] + " " + " ".join(PROMPTS)  # over CHUNK tokens
KV_REQUEST = "2"  # the request whose paging the runner dumps (--trace-kv)
# one request's boundaries before its first step, and in each step that gives it a token
ARRIVAL = ["input_processing", "zmq_send", "input_queue", "add_request"]
STEP = ["schedule", "execute_model", "update_from_output", "zmq_return", "output_received",
        "detokenize", "stop_check", "request_output"]  # fmt: skip

# Chrome's trace event format: the fields Perfetto needs, by phase
EVENT_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "ph", "pid", "tid", "args"],
                "properties": {
                    "name": {"type": "string"},
                    "ph": {"enum": ["X", "i", "M"]},
                    "pid": {"type": "integer"},
                    "tid": {"type": "integer"},
                    "ts": {"type": "number"},
                    "dur": {"type": "number", "minimum": 0},
                    "s": {"enum": ["t", "p", "g"]},
                    "args": {"type": "object"},
                },
                "allOf": [
                    {
                        "if": {"properties": {"ph": {"const": "X"}}},
                        "then": {"required": ["ts", "dur"]},
                    },
                    {"if": {"properties": {"ph": {"const": "i"}}}, "then": {"required": ["ts"]}},
                    {
                        "if": {"properties": {"ph": {"const": "M"}}},
                        "then": {
                            "properties": {"name": {"enum": ["process_name", "thread_name"]}},
                            "required": ["args"],
                        },
                    },
                ],  # fmt: skip
            },
        },
    },
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(trace path, outputs by request id): 8 requests, then a 9th that hits the prefix cache."""
    path = str(tmp_path_factory.mktemp("trace") / "journey.json")
    llm = LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=CHUNK, trace=path,
              trace_kv=KV_REQUEST)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = PROMPTS[:2] + [LONG] + PROMPTS[3:]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    outputs += llm.generate([LONG], params, use_tqdm=False)
    llm.shutdown()
    return path, {o.request_id: o for o in outputs}


def _names(events: list[dict]) -> list[str]:
    return [e["name"] for e in events]


def _last(events: list[dict], name: str, count: int) -> list[dict]:
    named = [e for e in events if e["name"] == name]
    assert len(named) >= count, (name, len(named))
    return named[-count:]


def test_trace_is_chrome_trace_json_with_both_processes(traced):
    path, _ = traced
    with open(path) as f:
        trace = json.load(f)
    jsonschema.validate(trace, EVENT_SCHEMA)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
                 and e["name"] == "process_name"}  # fmt: skip
    assert len(processes) == 2 and os.getpid() in processes
    assert sorted(p.split()[0] for p in processes.values()) == ["EngineCore", "caller"]


def test_every_request_crosses_every_boundary_in_order_on_one_clock(traced):
    path, outputs = traced
    events = load_events(path)
    for request_id in map(str, range(8)):
        mine = request_events(events, request_id)
        assert _names(mine[:4]) == ARRIVAL, request_id
        # one clock: what the caller sent arrives later in the core, and back
        caller_pid = mine[0]["pid"]
        assert mine[2]["pid"] != caller_pid and mine[1]["ts"] < mine[2]["ts"]
        # the steps that gave it a token (a prefill chunk before them gives none); the
        # core schedules step k + 1 while the caller still handles step k: k by k, not by time
        by_name = {name: _last(mine, name, MAX_TOKENS) for name in STEP}
        assert len([e for e in mine if e["name"] == "update_from_output"]) == MAX_TOKENS
        for k in range(MAX_TOKENS):
            step = [by_name[name][k] for name in STEP]
            stamps = [e["ts"] for e in step]
            assert stamps == sorted(stamps), (request_id, k, step)
            assert [e["pid"] == caller_pid for e in step] == [False] * 4 + [True] * 4
        assert mine[-1]["name"] == "request_output" and mine[-1]["args"]["finished"]


def test_token_counts_per_step(traced):
    path, outputs = traced
    events = load_events(path)
    for request_id, out in outputs.items():
        mine = request_events(events, request_id)
        scheduled = [e["args"] for e in mine if e["name"] == "schedule"]
        executed = [e["args"]["num_tokens"] for e in mine if e["name"] == "execute_model"]
        assert executed == [s["num_tokens"] for s in scheduled]
        hit = scheduled[0]["prefix_cache_hit_tokens"]
        num_prompt = len(out.prompt_token_ids)
        assert sum(executed) == num_prompt - hit + MAX_TOKENS - 1
        prefill = [s for s in scheduled if s["kind"] != "decode"]
        assert [s["num_tokens"] for s in scheduled[len(prefill) :]] == [1] * (MAX_TOKENS - 1)
        assert all(s["kind"] == "prefill chunk" for s in prefill[:-1])
        assert all(s["num_tokens"] <= CHUNK for s in prefill)
        sampled = [t for e in mine if e["name"] == "update_from_output"
                   for t in e["args"]["new_token_ids"]]  # fmt: skip
        assert sampled == out.outputs[0].token_ids
    long_first, long_again = (request_events(events, r) for r in (KV_REQUEST, "8"))
    assert sum(e["name"] == "schedule" and e["args"]["kind"] == "prefill chunk"
               for e in long_first) >= 1  # fmt: skip
    assert long_again[4]["args"]["prefix_cache_hit_tokens"] >= BLOCK  # the first's blocks


def test_block_ids_match_the_kv_cache_manager_and_the_runners_paging(traced):
    path, outputs = traced
    events = load_events(path)
    for request_id in outputs:
        blocks: list[int] = []
        for e in request_events(events, request_id):
            if e["name"] != "schedule":
                continue
            args = e["args"]  # the diff the runner got vs the manager's whole list
            blocks = args["new_block_ids"] if len(blocks) == 0 else blocks + args["new_block_ids"]
            assert blocks == args["block_ids"]
            assert len(blocks) == -(-(args["num_computed_tokens"] + args["num_tokens"]) // BLOCK)
    mine = request_events(events, KV_REQUEST)
    kv_dumps = [e["args"] for e in mine if e["name"] == "kv_paging"]
    schedules = [e["args"] for e in mine if e["name"] == "schedule"]
    assert len(kv_dumps) == len(schedules)  # one dump in each of its steps
    paging = zip(kv_dumps, schedules)
    for kv, scheduled in paging:
        assert kv["block_table"] == scheduled["block_ids"]  # the runner's row == the manager's
        expected = [kv["block_table"][p // BLOCK] * BLOCK + p % BLOCK for p in kv["positions"]]
        assert kv["slot_mapping"] == expected and len(expected) == scheduled["num_tokens"]


def test_summarize_walks_one_request_through(traced, capsys):
    path, _ = traced
    assert cli_main(["trace", "summarize", path, "--request-id", KV_REQUEST]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"request {KV_REQUEST}: ")
    lines = [line for line in text.splitlines() if " ms  [" in line]
    assert [line.split("] ")[1].split(" ")[0].rstrip(":") for line in lines[:5]] == [
        *ARRIVAL,
        "schedule",
    ]
    for name in STEP + ["kv_paging"]:
        assert f"] {name}" in text
    assert "Scheduler.schedule" in text and "slot_mapping=" in text
    assert cli_main(["trace", "summarize", path, "--request-id", "nope"]) == 2


def test_every_boundary_of_the_walkthrough_reports(traced):
    """Each boundary is an explicit call at its site: one that stops reporting (a renamed or
    moved method) fails here. Preemption needs a cache too small for this run."""
    from pagellm.tracing import _BOUNDARIES

    path, _ = traced
    names = {e["name"] for e in load_events(path) if e["ph"] != "M"}
    assert names == set(_BOUNDARIES) - {"preempted"}


def test_tracing_off_wraps_nothing(llm):
    engine = llm.llm_engine
    assert engine.tracer is None and engine.output_processor.tracer is None
    for obj, name in [(engine.engine_core, "get_output"), (engine.engine_core, "add_request"),
                      (engine.input_processor, "process_inputs"),
                      (engine.output_processor, "_detokenize")]:  # fmt: skip
        assert name not in vars(obj)  # the class's own method: no wrapper on the hot path


def test_async_engine_traces_the_same_boundaries(tmp_path):
    """The server's engine (AsyncLLM): its coroutine boundaries are traced the same way."""
    import asyncio

    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM

    path = str(tmp_path / "server.json")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=128,
                                                      trace=path))  # fmt: skip
        try:
            for i, prompt in enumerate(PROMPTS[:2]):
                async for _ in engine.generate(prompt, params, f"r{i}", priority=0):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(main())
    events = load_events(path)
    for request_id in ("r0", "r1"):
        names = _names(request_events(events, request_id))
        assert names[:4] == ARRIVAL and names[-1] == "request_output"
        assert [names.count(n) for n in STEP] == [2] * len(STEP)  # two tokens, two steps


def test_a_preemption_is_reported(tmp_path, monkeypatch):
    """13 usable blocks of 16 for 8 requests of ~50 tokens: the scheduler preempts, and the
    trace marks each preempted request (the in-process client: one process, two tracers)."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    path = str(tmp_path / "preempted.json")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(dtype="float32", max_model_len=256, num_gpu_blocks_override=14, trace=path) as llm:
        llm.generate(PROMPTS[:8], params, use_tqdm=False)
        assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    events = load_events(path)
    preempted = {e["args"]["request_id"] for e in events if e["name"] == "preempted"}
    scheduled = [e for e in events if e["name"] == "schedule" and e["args"].get("preempted")]
    assert preempted and preempted == {r for e in scheduled for r in e["args"]["preempted"]}


def test_speculative_decoding_shows_drafts_and_accepted_drafts(tmp_path, capsys):
    """ngram drafts on a tiny Llama (its prompt starts with the model's greedy continuation
    of it: the first drafts are accepted, later ones mostly not): each verify step's drafts
    when scheduled, its accepted drafts when back, and the request's totals at its end."""
    from draft_prompts import self_drafting_prompt
    from model_utils import hf_model, make_tiny_hf_model

    folder = make_tiny_hf_model("llama", tmp_path, vocab_size=64)
    prompt = self_drafting_prompt(hf_model(folder))
    path = str(tmp_path / "spec.json")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=folder, dtype="float32", speculative_config=spec, trace=path) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    drafted, accepted = out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens
    assert 0 < accepted < drafted
    events = load_events(path)
    mine = request_events(events, out.request_id)
    verifies = [
        e["args"] for e in mine if e["name"] == "schedule" and "num_draft_tokens" in e["args"]
    ]
    assert all(s["num_tokens"] == 1 + s["num_draft_tokens"] for s in verifies)
    assert sum(s["num_draft_tokens"] for s in verifies) == drafted
    steps = [e["args"] for e in events if e["name"] == "schedule" and e["tid"] == 0]
    assert sum(s.get("num_draft_tokens", 0) for s in steps) == drafted
    updates = [e["args"] for e in mine if e["name"] == "update_from_output"]
    verified = [u for u in updates if "num_draft_tokens" in u]
    assert [u["num_draft_tokens"] for u in verified] == [s["num_draft_tokens"] for s in verifies]
    assert sum(u["num_accepted_tokens"] for u in verified) == accepted
    for u in verified:  # the accepted drafts and one token more (max_tokens may cut it)
        assert len(u["new_token_ids"]) == u["num_accepted_tokens"] + 1 or u["finished"]
    end = mine[-1]
    assert end["name"] == "request_output" and end["args"]["finished"]
    assert (end["args"]["num_draft_tokens"], end["args"]["num_accepted_tokens"]) == (
        drafted,
        accepted,
    )
    assert cli_main(["trace", "summarize", path]) == 0
    text = capsys.readouterr().out
    assert f"num_draft_tokens={drafted}, num_accepted_tokens={accepted}" in text
