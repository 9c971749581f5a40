"""LLM.generate_stream: the same outputs as generate(), as they come; leaving early frees blocks."""

from __future__ import annotations

from conftest import PROMPTS

from pagellm import SamplingParams
from pagellm.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SOME = PROMPTS[:3]


def _with_kind(kind: RequestOutputKind, **changes) -> SamplingParams:
    params = GREEDY.clone()
    params.output_kind = kind
    for name, value in changes.items():
        setattr(params, name, value)
    return params


def _kv_usage(llm) -> float:
    return llm.llm_engine.call_utility("get_stats")["kv_cache_usage"]


def test_stream_final_only_equals_generate_in_completion_order(llm):
    # the later prompts ask for fewer tokens: they finish (and come out) first
    params = [_with_kind(RequestOutputKind.FINAL_ONLY, max_tokens=8 - 3 * i) for i in range(3)]
    expected = llm.generate(SOME, params, use_tqdm=False)
    streamed = list(llm.generate_stream(SOME, params))
    assert all(out.finished for out in streamed)
    assert [o.prompt for o in streamed] == SOME[::-1]  # completion order, not input order
    assert [o.outputs[0].token_ids for o in streamed] == [
        o.outputs[0].token_ids for o in expected[::-1]
    ]
    assert [o.outputs[0].text for o in streamed] == [o.outputs[0].text for o in expected[::-1]]


def test_stream_deltas_and_cumulative_add_up_to_generate(llm):
    expected = {o.prompt: o.outputs[0] for o in llm.generate(SOME, GREEDY, use_tqdm=False)}
    deltas: dict[str, list[int]] = {p: [] for p in SOME}
    text: dict[str, str] = {p: "" for p in SOME}
    for out in llm.generate_stream(SOME, _with_kind(RequestOutputKind.DELTA)):
        deltas[out.prompt] += out.outputs[0].token_ids
        text[out.prompt] += out.outputs[0].text
    assert deltas == {p: c.token_ids for p, c in expected.items()}
    assert text == {p: c.text for p, c in expected.items()}
    last = {}
    for out in llm.generate_stream(SOME, _with_kind(RequestOutputKind.CUMULATIVE)):
        before = last.get(out.prompt, [])
        assert out.outputs[0].token_ids[: len(before)] == before
        last[out.prompt] = out.outputs[0].token_ids
    assert last == deltas


def test_leaving_the_stream_early_aborts_the_rest_and_frees_their_blocks(llm):
    long = _with_kind(RequestOutputKind.DELTA, max_tokens=400)
    stream = llm.generate_stream(SOME, long)
    for _ in zip(range(3), stream):
        pass
    assert _kv_usage(llm) > 0  # the requests hold blocks while the iterator lives
    for _out in stream:
        break  # a plain break out of the loop: the iterator is dropped
    del stream, _out
    assert _kv_usage(llm) == 0
    assert not llm.llm_engine.has_unfinished_requests()
    # the engine carries on: a later generate() is unaffected
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_leaving_early_aborts_every_child_of_an_n_request(llm):
    params = _with_kind(RequestOutputKind.DELTA, max_tokens=400, n=3, temperature=0.8, seed=1)
    for _out in llm.generate_stream(SOME[:1], params):
        break
    del _out
    assert _kv_usage(llm) == 0
    assert llm.llm_engine.output_processor.parents == {}
    assert not llm.llm_engine.has_unfinished_requests()
    done = list(llm.generate_stream(SOME[:1], _with_kind(RequestOutputKind.FINAL_ONLY, n=2)))
    assert len(done) == 1 and len(done[0].outputs) == 2
    assert llm.llm_engine.output_processor.parents == {}  # a finished parent is forgotten
