"""SamplingParams.prompt_logprobs against HF transformers' log-softmax over the same prompt
(float32, embedded model): prompts longer than the token budget (chunked prefill), a prompt
already in the prefix cache (still every position), n > 1, async scheduling on and off,
streaming deltas, and the OpenAI completions endpoint's `echo` with `logprobs`."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import RequestOutputKind

K = 3


def _hf_prompt_logprobs(hf, prompt_ids: list[int]):
    """Per prompt token after the first: (its logprob, the top-K ids, the [lowest, highest]
    vocab rank it may have: tokens within 2e-4 of it may fall either side in the engine's
    own float32 arithmetic)."""
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt_ids])).logits[0, :-1].float()
    logprobs = logits.log_softmax(-1)
    target = torch.tensor(prompt_ids[1:])
    chosen = logprobs[torch.arange(len(target)), target]
    ranks = torch.stack(
        [
            (logprobs > chosen[:, None] + 2e-4).sum(-1) + 1,
            (logprobs >= chosen[:, None] - 2e-4).sum(-1),
        ],
        dim=-1,
    )
    return chosen, logprobs.topk(K, -1).indices, ranks


def _check(prompt_ids, prompt_logprobs, hf):
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    want, want_top, want_rank = _hf_prompt_logprobs(hf, prompt_ids)
    for pos, entry in enumerate(prompt_logprobs[1:]):
        token = prompt_ids[pos + 1]
        assert entry[token].logprob == pytest.approx(want[pos].item(), abs=2e-4)
        low, high = want_rank[pos].tolist()  # its rank in the whole vocabulary
        assert low <= entry[token].rank <= high
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= K)
        assert [tid for _, tid in top] == want_top[pos].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf(hf_smollm, async_scheduling):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (37, 5, 2, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)
    with LLM(
        dtype="float32", max_model_len=256, max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    ) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            _check(prompt, out.prompt_logprobs, hf_smollm)
        # the same prompt again: its blocks are cached, but every position is computed
        again = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
        assert again.num_cached_tokens == 0
        _check(prompts[0], again.prompt_logprobs, hf_smollm)
        # without prompt_logprobs the cache is used, and none are returned
        plain = SamplingParams(temperature=0.0, max_tokens=4)
        cached = llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False)[0]
        assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None
        assert cached.outputs[0].token_ids == outputs[0].outputs[0].token_ids
        # n > 1: the request's output carries them once for the prompt
        two = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=0)
        out = llm.generate({"prompt_token_ids": prompts[3]}, two, use_tqdm=False)[0]
        assert len(out.outputs) == 2
        assert [len(e) for e in out.prompt_logprobs[1:]] == [1] * (len(prompts[3]) - 1)
        _check_k0(prompts[3], out.prompt_logprobs, hf_smollm)


def _check_k0(prompt_ids, prompt_logprobs, hf):
    want, _, _ = _hf_prompt_logprobs(hf, prompt_ids)
    got = [entry[token].logprob for entry, token in zip(prompt_logprobs[1:], prompt_ids[1:])]
    assert got == pytest.approx(want.tolist(), abs=2e-4)


def test_prompt_logprobs_stream_once_and_validate(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    for too_many in ({"logprobs": 10**6}, {"prompt_logprobs": 21}):  # max_logprobs: 20
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate("Hi", SamplingParams(max_tokens=2, **too_many), use_tqdm=False)
    params = SamplingParams(
        max_tokens=5, temperature=0.0, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    engine = llm.llm_engine
    engine.add_request("delta-0", {"prompt_token_ids": [1, 2, 3, 4]}, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    assert seen[0] is not None and len(seen[0]) == 4 and seen[0][0] is None
    assert all(p is None for p in seen[1:])
    # n > 1: one stream for the request, the prompt's logprobs in it once (not once a child)
    three = msgspec.structs.replace(params, n=3, temperature=1.0, seed=2)
    engine.add_request("delta-1", {"prompt_token_ids": [1, 2, 3, 4]}, three)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    carrying = [p for p in seen if p is not None]
    assert len(seen) >= 3 and len(carrying) == 1 and len(carrying[0]) == 4


def test_sampled_tokens_carry_their_vocab_rank(llm, hf_smollm):
    """With temperature, sampled tokens are often outside the top k: their Logprob still
    has their rank (vLLM's), checked against HF's distribution over the same tokens."""
    prompt = llm.get_tokenizer().encode("Once upon a time")
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=12, logprobs=1, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    want, _, want_rank = _hf_prompt_logprobs(hf_smollm, prompt + out.token_ids)
    n = len(prompt)
    got = [entry[t].rank for entry, t in zip(out.logprobs, out.token_ids)]
    for rank, (low, high) in zip(got, want_rank[n - 1 :].tolist()):
        assert low <= rank <= high
    assert max(got) > 1  # some token was not the argmax: the test can fail


def test_a_tied_likeliest_token_is_rank_1():
    """vLLM's ranks: a token's rank counts the tokens at least as likely (2 when two tie at
    the top), but a token among the top k takes its top-k rank, so the likeliest is rank 1
    (bf16 logits tie often; `benchmarks/accuracy.py` looks up the rank-1 entry)."""
    from pagellm.engine.output_processor import _logprob_entry

    entry = _logprob_entry([-0.7, -0.7, -0.7], [5, 5, 9], rank=2)  # 5 and 9 tie at the top
    assert entry[5].rank == 1 and entry[9].rank == 2
    entry = _logprob_entry([-3.0, -0.1, -0.5], [4, 8, 6], rank=7)  # 4 outside the top 2
    assert (entry[4].rank, entry[8].rank, entry[6].rank) == (7, 1, 2)
