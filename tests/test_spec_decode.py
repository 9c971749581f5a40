"""Speculative decoding end to end on the embedded model (float32, CPU): with ngram drafts
verified every step (adaptive off) the greedy outputs are token for token those of the same
model without speculation (the session's `llm`), with everything else a request can ask for
in flight: max_tokens, stop ids and strings met inside a run of drafts, logprobs, penalties,
logit_bias, min_tokens, bad_words, structured outputs, n > 1, priorities, prefix caching, and
chunked prefill and preemption (a small KV cache and token budget). The engine runs in its
own process, so the drafts' counters cross the boundary too.
"""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.structured_output.params import StructuredOutputsParams

CODE = """def add_numbers(first_value, second_value):
    total = first_value + second_value
    print('The total of', first_value, 'and', second_value, 'is', total)
    return total


def scale(values, factor):
    scaled = [value * factor for value in values]
    return scaled
"""
# texts the model goes on copying (a file shown twice, a repeated sentence, a list), and a
# chat turn it answers in its own words
TEXTS = [
    f"# utils.py\n{CODE}\n# utils.py, unchanged:\ndef add_numbers(",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Shopping list:\n1. apples\n2. bread\n3. milk\n4. eggs\n\nShopping list, again:\n1.",
]
CHAT = "What is the capital of France? Explain in two sentences."
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,  # drafts whenever a match exists: many rejections too
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_llm():
    # 64-token steps: prompts prefill in chunks; 16 blocks of 16 tokens hold one or two
    # requests: a batch of four preempts
    engine = LLM(
        dtype="float32",
        max_model_len=1024,
        seed=0,
        speculative_config=SPEC,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=16,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=False
    )
    return [tokenizer.encode(t, add_special_tokens=False) for t in [*TEXTS, chat]]


def _ids(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def test_greedy_outputs_equal_speculation_off(llm, spec_llm, prompts):
    want, _ = _ids(llm, prompts, GREEDY)
    got, outs = _ids(spec_llm, prompts, GREEDY)
    assert got == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    # the code and the repeated sentence copy their prompts: most drafts are accepted; the
    # rest were rejected and rolled back
    assert accepted > 40 and drafted > accepted
    assert outs[0].metrics.num_accepted_tokens > 20
    stats = spec_llm.llm_engine.engine_core.call_utility("get_stats")
    assert stats["spec_decode_num_draft_tokens"] >= drafted
    assert stats["num_preemptions"] > 0  # preempted with drafts in flight, and still exact
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos[0] >= per_pos[3] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_is_never_exceeded(llm, spec_llm, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want, _ = _ids(llm, prompts[:2], params)
    got, _ = _ids(spec_llm, prompts[:2], params)
    assert got == want
    assert all(len(c[0]) == max_tokens for c in got)


def test_stops_inside_a_run_of_drafts(llm, spec_llm, prompts):
    """A stop id and a stop string met among accepted drafts end the output there."""
    (ref,), _ = _ids(llm, prompts[:1], GREEDY)
    ref = ref[0]
    # a token first seen at position >= 20, deep in the copied code
    pos = next(i for i in range(20, len(ref)) if ref[i] not in ref[:i])
    by_id = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[ref[pos]])
    want, _ = _ids(llm, prompts[:1], by_id)
    got, outs = _ids(spec_llm, prompts[:1], by_id)
    assert got == want and len(got[0][0]) == pos + 1
    assert outs[0].outputs[0].stop_reason == ref[pos]
    text = llm.get_tokenizer().decode(ref[pos : pos + 3])
    by_text = SamplingParams(temperature=0.0, max_tokens=64, stop=[text.strip()])
    want_text = llm.generate([{"prompt_token_ids": prompts[0]}], by_text, use_tqdm=False)
    got_text = spec_llm.generate([{"prompt_token_ids": prompts[0]}], by_text, use_tqdm=False)
    assert got_text[0].outputs[0].text == want_text[0].outputs[0].text
    assert got_text[0].outputs[0].finish_reason == "stop"


def test_logprobs_of_accepted_tokens(llm, spec_llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    want = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    got = spec_llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    got = got[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs):
        assert list(a) == list(b)  # the same sampled and top ids, in order
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
            assert a[token_id].rank == b[token_id].rank


@pytest.mark.parametrize(
    "settings",
    [
        dict(repetition_penalty=1.05, presence_penalty=0.1, frequency_penalty=0.1),
        dict(logit_bias={29: 2.0, 30: -5.0}),
        dict(min_tokens=40),
        dict(bad_words=["total", " result"]),
        dict(allowed_token_ids=list(range(30, 3000))),
        dict(structured_outputs=StructuredOutputsParams(choice=["yes, it is", "no, it is not"])),
        # copying the prompt's letters is allowed, its digits and punctuation are not
        dict(structured_outputs=StructuredOutputsParams(regex=r"[A-Za-z _(),:\n]{0,200}")),
    ],
    ids=["penalties", "logit_bias", "min_tokens", "bad_words", "allowed_ids", "choice", "regex"],
)
def test_every_sampling_feature_holds_with_drafts(llm, spec_llm, prompts, settings, request):
    """Each feature applies at every verify position (the drafts before it count as output):
    the same greedy ids as without speculation, and drafts verified with it."""
    params = SamplingParams(temperature=0.0, max_tokens=48, **settings)
    want, _ = _ids(llm, prompts[:2], params)
    got, outs = _ids(spec_llm, prompts[:2], params)
    assert got == want
    if request.node.callspec.id != "choice":  # two short answers: nothing to look up
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_grammar_and_penalties_with_async_scheduling(llm, prompts):
    """Under async scheduling a verify step counts no placeholder for its request (its tokens
    are counted once back): its grammar's masks and its penalties still apply at every
    position."""
    with LLM(dtype="float32", max_model_len=1024, speculative_config=SPEC,
             async_scheduling=True) as spec:  # fmt: skip
        for settings in (
            dict(structured_outputs=StructuredOutputsParams(regex=r"[A-Za-z _(),:\n]{0,200}")),
            dict(repetition_penalty=1.05, frequency_penalty=0.1, min_tokens=40),
        ):
            params = SamplingParams(temperature=0.0, max_tokens=40, **settings)
            want, _ = _ids(llm, prompts[:2], params)
            got, outs = _ids(spec, prompts[:2], params)
            assert got == want, settings
            assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_n_completions_seeds_and_priority(spec_llm, prompts):
    """Random sampling with drafts: a seeded request is reproducible; n > 1 completions each
    run their own drafts."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, n=2, seed=7)
    first, outs = _ids(spec_llm, prompts[:2], params)
    again, _ = _ids(spec_llm, prompts[:2], params)
    assert first == again
    assert all(len(c) == 2 for c in first)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    ranked = spec_llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, use_tqdm=False, priority=[1, 0]
    )
    assert all(o.finished for o in ranked)


def test_prefix_cache_hit_with_drafts(llm, spec_llm, prompts):
    want, _ = _ids(llm, prompts[:1], GREEDY)
    _ids(spec_llm, prompts[:1], GREEDY)
    got, outs = _ids(spec_llm, prompts[:1], GREEDY)
    assert got == want
    assert outs[0].num_cached_tokens > 0


def test_a_malformed_speculative_config_fails_at_start():
    with pytest.raises(ValueError, match="speculative_config method must be one of"):
        LLM(speculative_config={"method": "lookahead", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(speculative_config='{"method": "ngram", "num_speculative_token": 3}')
