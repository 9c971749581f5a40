"""Speculative decoding on a GPU (bf16, CUDA graphs on, async scheduling on): the embedded
model's real weights, ngram drafts verified every step. Greedy outputs follow speculation
off (bf16 rounds a verify step's multi-token forward unlike a one-token one, so a near-tie
may flip late: the outputs must agree for most of their length, and exactly where they copy
the prompt); drafts are accepted; seeded random sampling is reproducible; logprobs come with
every accepted token."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import SPEC, TEXTS

from pagellm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    kwargs = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=2 << 30)
    off = LLM(**kwargs)
    spec = LLM(**kwargs, speculative_config=SPEC)
    yield off, spec
    spec.shutdown()
    off.shutdown()


def _generate(llm, params, n=len(TEXTS)):
    return llm.generate(TEXTS[:n], params, use_tqdm=False)


def test_greedy_follows_speculation_off(engines):
    off, spec = engines
    want = [o.outputs[0].token_ids for o in _generate(off, GREEDY)]
    outs = _generate(spec, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    agree = []
    for a, b in zip(got, want):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        agree.append(same)
    assert sum(agree) >= 0.75 * sum(len(w) for w in want), agree
    assert agree[1] == len(want[1])  # the repeated sentence: copied exactly
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted > 40
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)


def test_penalties_and_a_grammar_hold_at_every_verify_position(engines):
    """On the device too: penalties count the drafts before each verify row, a regex masks
    every position; drafts flow, the output keeps the regex and follows speculation off."""
    import re

    from pagellm.structured_output.params import StructuredOutputsParams

    off, spec = engines
    pattern = r"[A-Za-z _(),:\n]{0,200}"
    for settings in (
        dict(repetition_penalty=1.05, frequency_penalty=0.1, min_tokens=40),
        dict(structured_outputs=StructuredOutputsParams(regex=pattern)),
    ):
        params = SamplingParams(temperature=0.0, max_tokens=48, **settings)
        want = [o.outputs[0].token_ids for o in _generate(off, params, 2)]
        outs = _generate(spec, params, 2)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, settings
        agree = sum(a[:16] == b[:16] for a, b in zip(want, (o.outputs[0].token_ids for o in outs)))
        assert agree >= 1, settings
        if "structured_outputs" in settings:
            assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outs)


def test_seeded_sampling_is_reproducible_and_logprobs_follow_tokens(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.7, max_tokens=48, seed=11, logprobs=3)
    # the same steps both times: bf16 rounds a prefix-cache hit's shorter forward otherwise
    spec.reset_prefix_cache()
    first = _generate(spec, params)
    spec.reset_prefix_cache()
    again = _generate(spec, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    for out in first:
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and len(entry) >= 3


def test_batch1_timing_is_reported(engines, capsys):
    """Batch 1 on three grounded prompts (benchmarks/spec_decode_prompts.py), speculation off
    and on: printed for the notes, not asserted (a timed test is no benchmark); the tokens
    must still follow speculation off for most of their length."""
    import time

    from benchmark_modules import load

    prompts = load("spec_decode_prompts").tokenize_sets(["grounded"], 3)["grounded"]
    params = SamplingParams(temperature=0.0, max_tokens=128)
    rates, outputs = [], []
    # and with the drafts adaptive (the default): as many as the measured costs pay for
    adaptive = LLM(
        dtype="bfloat16",
        max_model_len=2048,
        kv_cache_memory_bytes=2 << 30,
        speculative_config={**SPEC, "adaptive": True, "prompt_lookup_min": 2},
    )
    for llm in (*engines, adaptive):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm
        start, tokens, outs = time.perf_counter(), 0, []
        for ids in prompts:
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            tokens += len(out.outputs[0].token_ids)
            outs.append(out.outputs[0].token_ids)
        rates.append(tokens / (time.perf_counter() - start))
        outputs.append(outs)
    adaptive.shutdown()
    with capsys.disabled():
        print(f"\nbatch 1, grounded: off {rates[0]:.1f} tok/s, ngram {rates[1]:.1f} tok/s "
              f"({rates[1] / rates[0]:.2f}x), adaptive ngram {rates[2]:.1f} tok/s "
              f"({rates[2] / rates[0]:.2f}x)")  # fmt: skip
    for drafted in outputs[1:]:
        assert sum(a[:32] == b[:32] for a, b in zip(outputs[0], drafted)) >= 2
