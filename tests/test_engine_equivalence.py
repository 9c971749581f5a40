"""The same greedy tokens whatever the engine does inside: prefix caching, preemption, chunking."""

from __future__ import annotations

import pytest
from conftest import PROMPTS

from pagellm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, in plain English, without "
    "lists, and say so when you do not know the answer. Here is the question. "
)
PREFIXED = [SHARED_PREFIX + p for p in PROMPTS]


# Every engine here dequantizes the embedded GGUF file (quantization="none"): the default
# reads its blocks for decodes of a few rows but runs prefill through the dequantized copy,
# so a recomputed or re-chunked prompt differs from the first pass by summation order, and
# these tests compare token ids exactly.
ENGINE = dict(dtype="float32", max_model_len=1024, quantization="none")


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE, seed=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    """Token ids from the module's engine (prefix caching on, roomy cache)."""
    return _token_ids(llm, PREFIXED)


def _token_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_prefix_cache_hits_do_not_change_outputs(llm, reference):
    assert llm.reset_prefix_cache()
    first = llm.generate(PREFIXED[:1], PARAMS, use_tqdm=False)
    again = llm.generate(PREFIXED, PARAMS, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    # the shared prefix (two full blocks) came from the cache
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert [o.outputs[0].token_ids for o in again] == reference


def test_prefix_caching_off_gives_same_outputs(reference):
    with LLM(**ENGINE, enable_prefix_caching=False) as llm:
        outputs = llm.generate(PREFIXED, PARAMS, use_tqdm=False)
        assert all(o.num_cached_tokens == 0 for o in outputs)
        assert [o.outputs[0].token_ids for o in outputs] == reference


def test_preemption_gives_same_outputs(reference):
    # 8 requests of ~70 tokens need ~40 blocks of 16; 14 blocks force preemption by recompute
    with LLM(**ENGINE, num_gpu_blocks_override=14) as llm:
        assert _token_ids(llm, PREFIXED) == reference
        stats = llm.llm_engine.call_utility("get_stats")
        assert stats["num_preemptions"] > 0
        assert llm.llm_engine.call_utility("get_num_free_blocks") == 13  # all but the null block


def test_chunked_prefill_gives_same_outputs(reference):
    # a budget of 8 tokens a step splits every prompt into several chunks
    with LLM(**ENGINE, max_num_batched_tokens=8) as llm:
        assert _token_ids(llm, PREFIXED) == reference


def test_async_scheduling_gives_same_outputs(llm, reference):
    """Scheduling step N+1 before step N's tokens are back (the CUDA default; it runs on the
    CPU too) changes no token, finish reason or stop, even under preemption and chunking."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 17, 48)
    ]
    stop_id = reference[5][9]  # the token prompt 5 produces at step 10
    early_id = reference[6][3]  # prompt 6's 4th token, banned before min_tokens
    params += [
        SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[early_id]),
        SamplingParams(temperature=0.0, max_tokens=48),  # stops at EOS, if it comes
    ]
    prompts = PREFIXED[: len(params)]
    sync = llm.generate(prompts, params, use_tqdm=False)
    args = dict(ENGINE, async_scheduling=True)
    with LLM(**args, num_gpu_blocks_override=14, max_num_batched_tokens=32) as async_llm:
        assert _token_ids(async_llm, PREFIXED) == reference
        assert async_llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
        outputs = async_llm.generate(prompts, params, use_tqdm=False)
        for got, want in zip(outputs, sync, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
            assert got.outputs[0].stop_reason == want.outputs[0].stop_reason
        assert [len(o.outputs[0].token_ids) for o in outputs[:5]] == [1, 2, 5, 17, 48]
        assert outputs[5].outputs[0].stop_reason == stop_id
        assert len(outputs[5].outputs[0].token_ids) <= 10
        assert len(outputs[6].outputs[0].token_ids) >= 12
        assert async_llm.llm_engine.call_utility("get_num_free_blocks") == 13
