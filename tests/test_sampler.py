"""Sampler: greedy, temperature, top-k, top-p, min-p, seeds, min_tokens bans, logprobs."""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.min_tokens import MinTokens
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler, argmax_rows


def _meta(b, temperature=1.0, top_k=None, top_p=None, min_p=None, **kw) -> SamplingMetadata:
    temp = torch.full((b,), float(temperature))
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp < 1e-5).all()),
        all_random=bool((temp >= 1e-5).all()),
        top_k=None if top_k is None else torch.full((b,), top_k),
        top_p=None if top_p is None else torch.full((b,), float(top_p)),
        min_p=None if min_p is None else torch.full((b,), float(min_p)),
        **kw,
    )


def _logits(b=4, v=50, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = Sampler()(logits.clone(), _meta(4, temperature=0.0))
    assert torch.equal(out.sampled, logits.argmax(-1))


def test_argmax_rows_equals_argmax_with_ties():
    """The chunked CPU argmax gives torch's indices, the first of tied maxima included."""
    gen = torch.Generator().manual_seed(1)
    for width in (50, 1024, 4096, 49152, 151936, 3000):  # one chunk, several, 128-wide, none
        x = torch.randn(7, width, generator=gen)
        x[1, width // 3] = x[1, width - 1] = x[1].max() + 1  # tie across chunks
        x[2, 5] = x[2, 6] = x[2].max() + 1  # tie inside one chunk
        x[3] = 0.0  # all equal: index 0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), width


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits()
    assert torch.equal(Sampler()(logits.clone(), _meta(4, top_k=1)).sampled, logits.argmax(-1))
    assert torch.equal(Sampler()(logits.clone(), _meta(4, top_p=1e-6)).sampled, logits.argmax(-1))


def test_top_k_samples_only_top_tokens():
    logits = _logits(b=1).expand(2000, -1).clone()
    allowed = set(logits[0].topk(3).indices.tolist())
    sampled = Sampler()(logits, _meta(2000, top_k=3)).sampled
    assert set(sampled.tolist()) == allowed


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(3000, -1).clone()
    sampled = Sampler()(logits, _meta(3000, top_p=0.7)).sampled
    assert set(sampled.tolist()) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04]])).expand(3000, -1).clone()
    sampled = Sampler()(logits, _meta(3000, min_p=0.2)).sampled
    assert set(sampled.tolist()) == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).expand(20000, -1).clone()
    sampled = Sampler()(logits, _meta(20000, temperature=1.0)).sampled
    freq = torch.bincount(sampled, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_sharpens():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).expand(20000, -1).clone()
    sampled = Sampler()(logits, _meta(20000, temperature=0.25)).sampled
    expected = torch.softmax(torch.log(probs) / 0.25, -1)
    freq = torch.bincount(sampled, minlength=4).float() / 20000
    assert torch.allclose(freq, expected, atol=0.015)


def test_seeded_rows_are_reproducible_and_independent_of_batch():
    logits = _logits(b=1, v=1000).expand(3, -1).clone()

    def draw(rows):
        gens = {i: torch.Generator().manual_seed(42) for i in rows}
        return Sampler()(logits[: len(rows)].clone(), _meta(len(rows), generators=gens)).sampled

    runs = [draw([0]).item() for _ in range(5)]
    assert len(set(runs)) == 1
    assert draw([0, 1, 2]).tolist() == [runs[0]] * 3


def test_banned_tokens_are_never_sampled():
    logits = _logits()
    top = logits.argmax(-1)
    banned = [(i, [int(top[i])]) for i in range(4)]
    bans = MinTokens(4, 50, torch.device("cpu"))
    meta = _meta(4, temperature=0.0, processors=[(bans, banned)])
    out = Sampler()(logits.clone(), meta).sampled
    assert not (out == top).any()


def test_logprobs_of_sampled_and_top_tokens():
    logits = _logits()
    out = Sampler()(logits.clone(), _meta(4, temperature=0.0, max_num_logprobs=2))
    ref = logits.log_softmax(-1)
    assert torch.equal(out.logprob_ids[:, 0], logits.argmax(-1))
    assert torch.allclose(out.logprobs[:, 0], ref.max(-1).values)
    assert torch.equal(out.logprob_ids[:, 1:], ref.topk(2).indices)
