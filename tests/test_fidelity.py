"""Greedy token ids equal HF transformers' on CPU in float32, with requests batched together."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_greedy

from pagellm import LLM, SamplingParams

GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_embedded_model_matches_hf(llm, hf_smollm):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, GREEDY_64, use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy(hf_smollm, tokenizer.encode(prompt), 64)
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tiny_random_models_match_hf(arch, tmp_path):
    from model_utils import make_tiny_hf_model
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model(arch, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (5, 17, 33, 64, 3, 40)]
    with LLM(model=folder, dtype="float32", block_size=4, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY_64, use_tqdm=False
        )
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 64)
