"""Repetition, frequency and presence penalties: the sampler's arithmetic, validation, and
greedy continuations against HF transformers' generation loop with the same penalties
(HF's own RepetitionPenaltyLogitsProcessor; frequency/presence as OpenAI defines them),
with async scheduling on and off."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_tiny_hf_model
from transformers import AutoModelForCausalLM, LogitsProcessor, RepetitionPenaltyLogitsProcessor

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.sample.penalties import PenaltyParams, PenaltyState


def _params(state, rows, presence, frequency, repetition) -> PenaltyParams:
    return PenaltyParams(
        state=state,
        rows=torch.tensor(rows),
        presence=torch.tensor(presence),
        frequency=torch.tensor(frequency),
        repetition=torch.tensor(repetition),
    )


def test_penalty_arithmetic_and_counting():
    state = PenaltyState(max_num_reqs=3, vocab_size=6, device=torch.device("cpu"))
    state.add_request(2, prompt_ids=[0, 1], output_ids=[3])  # a resumed request: one output
    state.add_request(0, prompt_ids=[5], output_ids=[])
    params = _params(state, [2, 0], [0.5, 0.0], [0.25, 0.0], [2.0, 1.0])
    params.record(torch.tensor([3, 4]))  # row 2 samples 3 again, row 0 samples 4
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    out = params.apply(logits.clone())
    # row 2: prompt {0, 1} and output {3: twice}: repetition on 0, 1, 3; then 3 pays
    # frequency 2 * 0.25 and presence 0.5
    assert out[0].tolist() == [1.0, -4.0, 1.0, 2.0 - 0.5 - 0.5, 1.0, 1.0]
    assert torch.equal(out[1], logits[1])  # neutral settings change nothing
    assert state.output_counts[0].tolist() == [0, 0, 0, 0, 1, 0]
    state.add_request(2, prompt_ids=[4], output_ids=[])  # a new request takes row 2
    assert state.output_counts[2].tolist() == [0] * 6
    assert state.prompt_mask[2].tolist() == [False] * 4 + [True, False]


@pytest.mark.parametrize(
    "field,value",
    [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)],
)
def test_invalid_penalties_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_server_requests_carry_penalties():
    request = CompletionRequest(prompt="hi", presence_penalty=0.5, repetition_penalty=1.2)
    params = request.to_sampling_params(max_tokens=4, logprobs=None)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.0)
    assert params.repetition_penalty == 1.2 and params.has_penalties
    assert not SamplingParams().has_penalties


class _OpenAIPenalties(LogitsProcessor):
    """frequency / presence penalties over the generated part of input_ids."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        return scores - self.frequency * counts - self.presence * (counts > 0)


def _hf_greedy_with(model, prompt: list[int], new_tokens: int, params: SamplingParams):
    processors = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(
            _OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)
        )
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(new_tokens):  # no KV cache: short sequences, plain and obviously right
            scores = model(input_ids=ids).logits[:, -1].float()
            for proc in processors:
                scores = proc(ids, scores)
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_hf(tmp_path, async_scheduling):
    folder = make_tiny_hf_model("llama", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (6, 19, 11, 30)]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [
        SamplingParams(repetition_penalty=1.8, **greedy),
        SamplingParams(frequency_penalty=1.5, presence_penalty=1.0, **greedy),
        SamplingParams(**greedy),  # no penalty, batched with the others
        SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5, **greedy),
    ]
    with LLM(
        model=folder, dtype="float32", block_size=4, max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    ) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = [_hf_greedy_with(hf, p, 24, SamplingParams(**greedy)) for p in prompts]
    for prompt, sp, out, unpenalized in zip(prompts, params, outputs, plain):
        expected = _hf_greedy_with(hf, prompt, 24, sp)
        assert out.outputs[0].token_ids == expected
        if sp.has_penalties:  # the penalty changed the continuation: the test can fail
            assert expected != unpenalized
