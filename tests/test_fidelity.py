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


BF16_PROMPTS = [*PROMPTS, "Photosynthesis is the process by which", "import numpy as np\n",
                "The best way to learn a language is", "Dear hiring manager,",
                "A haiku about autumn:", "SELECT name FROM", "The sun rises in the",
                "Three reasons to exercise:"]  # fmt: skip


def test_embedded_model_bf16_agrees_with_hf_bf16(embedded_gguf):
    """Where the CPU runs bf16 (our panels, the C++ decoder loop, bf16 attention), against
    HF's own model in bf16 on the same (dequantized) weights, 32 greedy tokens per prompt.
    A regression floor, not issue 17's goal (90% identical): bf16 sums in another order than
    HF's flip near ties, after which a continuation diverges; measured 8 / 16 identical (10 /
    16 with oneDNN's bf16 GEMMs), docs/notes.md."""
    from transformers import AutoModelForCausalLM

    from pagellm.utils import cpu_bf16_units

    if cpu_bf16_units() is None:
        pytest.skip("bf16 on the CPU needs AMX or AVX512-BF16")
    folder, name = embedded_gguf
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(dtype="bfloat16", quantization="none", max_model_len=512) as llm:
        tokenizer = llm.get_tokenizer()
        outputs = llm.generate(BF16_PROMPTS, params, use_tqdm=False)
    common = []  # leading tokens identical to HF's, per prompt
    for prompt, out in zip(BF16_PROMPTS, outputs, strict=True):
        ours, theirs = out.outputs[0].token_ids, hf_greedy(hf.eval(), tokenizer.encode(prompt), 32)
        common.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 32))
    print("bf16 leading tokens identical to HF's:", common)
    assert sum(n == 32 for n in common) >= 0.35 * len(common), common
    assert sum(common) / len(common) >= 16, common
