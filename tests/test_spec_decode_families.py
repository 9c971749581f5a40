"""Speculative decoding is lossless in every family the project serves: a tiny random
checkpoint per family (test_families' quirks: soft-caps, sliding windows, longrope crossing
its switch, q/k norms, NoPE layers, multipliers) decodes greedily with ngram drafts verified
every step (adaptive off) and gives HF's greedy token ids, batched, with chunked prefill and
a KV cache small enough to preempt, while drafts are verified and rolled back.
The suffix method runs on two of them the same way."""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model
from test_families import FAMILIES, NUM_BLOCKS

from pagellm import LLM, SamplingParams

ARCHS = {"llama": {}, "mistral": dict(sliding_window=12), "qwen2": {}, "qwen3": {}, **FAMILIES}
NEW_TOKENS = 40
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
    "adaptive": False,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}


def _prompts() -> list[list[int]]:
    """Two random prompts and two that repeat a phrase (drafts find matches in them), all of
    18 tokens (HF's reference runs them as one batch)."""
    gen = torch.Generator().manual_seed(5)
    rand = [torch.randint(6, 500, (18,), generator=gen).tolist() for _ in range(2)]
    phrase = torch.randint(6, 500, (6,), generator=gen).tolist()
    return [*rand, phrase * 3, phrase[:4] * 3 + phrase]


def _run(
    folder: str, spec: dict, num_blocks: int, **engine_args
) -> tuple[list[list[int]], int, int]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            folder,
            dtype="float32",
            block_size=4,
            num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=32,
            speculative_config=spec,
            **engine_args,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    finally:
        llm.shutdown()
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs], drafted, accepted


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ngram_greedy_equals_hf(arch, tmp_path):
    folder = make_tiny_hf_model(arch, tmp_path, **ARCHS[arch])
    want = hf_generate_greedy(hf_model(folder), _prompts(), NEW_TOKENS)
    got, drafted, accepted = _run(folder, NGRAM, NUM_BLOCKS.get(arch, 30))
    assert got == want
    # drafts verified and most rolled back (random weights rarely repeat their prompt: the
    # embedded model's test counts accepted ones)
    assert drafted > accepted


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_suffix_greedy_equals_hf(arch, tmp_path):
    folder = make_tiny_hf_model(arch, tmp_path, **ARCHS[arch])
    want = hf_generate_greedy(hf_model(folder), _prompts(), NEW_TOKENS)
    got, drafted, accepted = _run(folder, SUFFIX, 30)
    assert got == want
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_async_scheduling_greedy_equals_hf(arch, tmp_path):
    """Async scheduling: steps overlap while no drafts come, and a step with drafts waits for
    the one before it (the adaptive count starts drafting, stops and probes again)."""
    folder = make_tiny_hf_model(arch, tmp_path, **ARCHS[arch])
    want = hf_generate_greedy(hf_model(folder), _prompts(), NEW_TOKENS)
    spec = {**NGRAM, "adaptive": True}
    got, drafted, _ = _run(folder, spec, NUM_BLOCKS.get(arch, 30), async_scheduling=True)
    assert got == want
    assert drafted > 0
