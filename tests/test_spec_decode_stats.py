"""Random sampling with ngram drafts keeps the target's distribution exactly, on a real model:
a tiny random Llama (vocabulary 64, float32) generates 3 tokens for thousands of requests with
drafts verified (at temperature 1, and at 0.8 with top-k 8), and the tokens' joint
distribution and each position's marginal fit the exact distribution HF's model gives by
enumeration (Pearson's chi-square).

The prompt is built so that drafts flow and are often, but not always, right: it starts with
the model's own greedy continuation of it, so the first sampled token usually repeats the
prompt's first token and prompt lookup drafts what followed it there. Seeded requests (each
token drawn by its seed and position) and unseeded ones (the engine's generator) both fit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draft_prompts import next_logits, self_drafting_prompt
from model_utils import hf_model, make_tiny_hf_model
from test_spec_decode_units import _chi2_ok

from pagellm import LLM, SamplingParams

VOCAB = 64
NUM_REQUESTS = 2000
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("stats"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def target(model_folder):
    """(the prompt, the logits of its 1st token [VOCAB], 2nd [VOCAB, VOCAB] and 3rd
    [VOCAB, VOCAB, VOCAB] after each token before it)."""
    model = hf_model(model_folder)
    prompt = self_drafting_prompt(model)
    l1 = next_logits(model, [prompt])[0]
    l2 = next_logits(model, [prompt + [a] for a in range(VOCAB)])
    pairs = [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    return prompt, (l1, l2, next_logits(model, pairs).view(VOCAB, VOCAB, VOCAB))


def _joint(logits: tuple[torch.Tensor, ...], temperature: float, top_k: int) -> np.ndarray:
    """The 3 tokens' exact joint distribution [VOCAB, VOCAB, VOCAB] at these settings."""
    probs = []
    for rows in logits:
        rows = rows / temperature
        if top_k > 0:
            kth = rows.topk(top_k, dim=-1).values[..., -1:]
            rows = rows.masked_fill(rows < kth, float("-inf"))
        probs.append(torch.softmax(rows, dim=-1))
    p1, p2, p3 = probs
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


@pytest.fixture(scope="module")
def spec_llm(model_folder):
    with LLM(
        model=model_folder,
        dtype="float32",
        seed=0,
        speculative_config=SPEC,
        num_gpu_blocks_override=1024,
    ) as llm:
        yield llm


@pytest.mark.parametrize(
    ("seeded", "temperature", "top_k"),
    [(True, 1.0, 0), (False, 0.8, 8)],
    ids=["seeded", "unseeded-top_k"],
)
def test_sampled_tokens_follow_the_target_distribution(
    spec_llm, target, seeded, temperature, top_k
):
    prompt, logits = target
    joint = _joint(logits, temperature, top_k)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, ignore_eos=True,
                       seed=i if seeded else None)
        for i in range(NUM_REQUESTS)
    ]  # fmt: skip
    outs = spec_llm.generate([{"prompt_token_ids": prompt}] * NUM_REQUESTS, params, use_tqdm=False)
    # the first 3 of 4 tokens: after the first, 2 drafts verified for the next 2 and a bonus
    tokens = np.array([o.outputs[0].token_ids[:3] for o in outs])  # [NUM_REQUESTS, 3]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    # drafts were verified for most requests, and many were accepted and many rejected
    assert drafted > NUM_REQUESTS and 0.2 * drafted < accepted < 0.8 * drafted
    cells = np.ravel_multi_index(tokens.T, joint.shape)
    counts = np.bincount(cells, minlength=joint.size)
    assert counts[joint.ravel() == 0].sum() == 0  # nothing top-k excludes
    assert _chi2_ok(counts, joint.ravel())
    for axis in range(3):
        marginal = joint.sum(axis=tuple(a for a in range(3) if a != axis))
        assert _chi2_ok(np.bincount(tokens[:, axis], minlength=VOCAB), marginal)
