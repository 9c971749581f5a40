"""Logits processing before sampling: repetition, frequency and presence penalties,
logit_bias and allowed_token_ids. The sampler's arithmetic, validation, and greedy
continuations against HF transformers' generation loop with the same processing (HF's own
RepetitionPenaltyLogitsProcessor and SequenceBiasLogitsProcessor; frequency/presence as
OpenAI defines them; a whitelist mask), with async scheduling on and off."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_tiny_hf_model
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pagellm import LLM, SamplingParams
from pagellm.sample.logits_processor.penalties import PenaltyParams, PenaltyState


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


def test_server_requests_carry_penalties_and_biases():
    pytest.importorskip("pydantic")  # the server's extra (absent on the GPU machine)
    from pagellm.entrypoints.openai.protocol import CompletionRequest

    request = CompletionRequest(
        prompt="hi", presence_penalty=0.5, repetition_penalty=1.2, logit_bias={"7": 250.0}
    )
    params = request.to_sampling_params(max_tokens=4, logprobs=None)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.0)
    assert params.repetition_penalty == 1.2 and params.has_penalties
    assert params.logit_bias == {7: 100.0}  # string keys to ids, clamped to OpenAI's range
    assert not SamplingParams().has_penalties


def test_bias_and_allowed_tokens_are_checked(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids has token id -1"):
        SamplingParams(allowed_token_ids=[-1])  # below any vocabulary: refused at once
    with LLM(model=folder, dtype="float32") as llm:
        vocab = llm.llm_engine.config.model_config.vocab_size
        for bad in (
            SamplingParams(logit_bias={vocab: 1.0}),
            SamplingParams(allowed_token_ids=[vocab]),
        ):
            with pytest.raises(ValueError, match="out of vocabulary"):
                llm.generate({"prompt_token_ids": [1, 2]}, bad, use_tqdm=False)
        out = llm.generate(
            {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 3  # the engine still serves


class _OpenAIPenalties(LogitsProcessor):
    """frequency / presence penalties over the generated part of input_ids."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        return scores - self.frequency * counts - self.presence * (counts > 0)


class _AllowOnly(LogitsProcessor):
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.token_ids] = scores[:, self.token_ids]
        return masked


def _hf_greedy_with(model, prompt: list[int], new_tokens: int, params: SamplingParams):
    processors = []  # in vLLM's order: allowed tokens, logit bias, penalties
    if params.allowed_token_ids:
        processors.append(_AllowOnly(params.allowed_token_ids))
    if params.logit_bias:
        bias = {(token,): value for token, value in params.logit_bias.items()}
        processors.append(SequenceBiasLogitsProcessor(bias))
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
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (6, 19, 11, 30, 8, 14)]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [
        SamplingParams(repetition_penalty=1.8, **greedy),
        SamplingParams(frequency_penalty=1.5, presence_penalty=1.0, **greedy),
        SamplingParams(**greedy),  # no penalty, batched with the others
        SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5, **greedy),
        SamplingParams(logit_bias={11: 3.0, 42: -1.5, 300: 2.5}, repetition_penalty=1.3, **greedy),
        SamplingParams(allowed_token_ids=[5, 17, 99, 123, 400], **greedy),
    ]
    with LLM(
        model=folder, dtype="float32", block_size=16 if torch.cuda.is_available() else 4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    ) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = [_hf_greedy_with(hf, p, 24, SamplingParams(**greedy)) for p in prompts]
    for prompt, sp, out, unpenalized in zip(prompts, params, outputs, plain):
        expected = _hf_greedy_with(hf, prompt, 24, sp)
        assert out.outputs[0].token_ids == expected
        if sp.has_penalties or sp.logit_bias or sp.allowed_token_ids:
            assert expected != unpenalized  # the processing changed it: the test can fail
        if sp.allowed_token_ids:
            assert set(expected) <= set(sp.allowed_token_ids)
