"""Prompts that make a tiny random model's drafts flow, for the speculative decoding tests:
random weights rarely continue their prompt, so prompt lookup's drafts are rarely right
unless the prompt is chosen for it (from HF's model of the checkpoint).

- `self_drafting_prompt(model)`: a prompt that starts with (nearly) the model's greedy
  continuation of it: the first drafts are likely, also when sampling.
- `looping_prompt(model)`: the random prompt over a few tokens whose greedy continuation
  prompt lookup drafts right most often; with that continuation (the greedy reference).
"""

from __future__ import annotations

import numpy as np
import torch
from model_utils import hf_generate_greedy

from pagellm.spec_decode.ngram import ngram_drafts


def next_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """The next token's logits after each of equally long seqs: [len(seqs), vocab] float64."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor(seqs)).logits[:, -1].double()


def next_probs(model, seqs: list[list[int]]) -> torch.Tensor:
    """p(next token | seq) for equally long seqs: [len(seqs), vocab] float64."""
    return torch.softmax(next_logits(model, seqs), dim=-1)


def self_drafting_prompt(model) -> list[int]:
    """Three tokens that are (nearly) the model's greedy continuation of the whole prompt,
    then a random tail: found by putting the continuation in front and recomputing it, for
    8 tails at once; the prompt whose first two sampled tokens most likely repeat its first
    two (its first draft accepted)."""
    gen = torch.Generator().manual_seed(0)
    tails = torch.randint(3, model.config.vocab_size, (8, 10), generator=gen)
    heads = torch.zeros(8, 0, dtype=torch.int64)
    for _ in range(6):
        seqs = torch.cat([heads, tails], dim=1)
        for _ in range(3):
            best = next_probs(model, seqs.tolist()).argmax(dim=1, keepdim=True)
            seqs = torch.cat([seqs, best], dim=1)
        heads = seqs[:, -3:]
    prompts = torch.cat([heads, tails], dim=1)
    rows = torch.arange(8)
    first = next_probs(model, prompts.tolist())[rows, heads[:, 0]]
    second = next_probs(model, torch.cat([prompts, heads[:, :1]], dim=1).tolist())
    return prompts[int((first * second[rows, heads[:, 1]]).argmax())].tolist()


def looping_prompt(model, num_tokens: int = 16) -> tuple[list[int], list[int]]:
    """(prompt, its greedy continuation of num_tokens): of 64 random 24-token prompts over
    4 tokens each, the one whose continuation's tokens a 1-to-3-gram lookup over the tokens
    before each drafts right most often (such prompts send a random model into loops)."""
    gen = torch.Generator().manual_seed(0)
    alphabets = torch.randint(3, model.config.vocab_size, (64, 4), generator=gen)
    prompts = torch.gather(alphabets, 1, torch.randint(0, 4, (64, 24), generator=gen)).tolist()
    continuations = hf_generate_greedy(model, prompts, num_tokens)

    def hits(prompt: list[int], continuation: list[int]) -> int:
        seq = np.array(prompt + continuation)
        ends = range(len(prompt) + 1, len(seq))
        return sum(ngram_drafts(seq[:i], 1, 3, 1) == [seq[i]] for i in ends)

    best = max(range(64), key=lambda i: hits(prompts[i], continuations[i]))
    return prompts[best], continuations[best]
