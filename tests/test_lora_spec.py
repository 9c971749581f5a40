"""Speculative decoding (ngram prompt lookup) with LoRA adapters: a verify step's draft rows
carry their request's adapter (its tokens grouped by slot like any other rows). Per request,
adapters and the base model mixed in one call, the greedy ids equal HF + PEFT's (what decoding
without drafts gives: tests/test_lora.py), with drafts accepted under each adapter."""

from __future__ import annotations

import pytest
from draft_prompts import looping_prompt
from lora_utils import make_peft_adapter
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
ADAPTERS = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj", "up_proj"]),
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    folder = make_tiny_hf_model("llama", tmp, std=0.3)
    save_tiny_tokenizer(folder)
    refs, loras = {None: hf_model(folder)}, {None: None}
    for i, config in enumerate(ADAPTERS):
        path, refs[i] = make_peft_adapter(folder, config, tmp / f"a{i}", seed=20 + i, std=0.2)
        loras[i] = LoRARequest(f"a{i}", i + 1, path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            folder, dtype="float32", max_model_len=128, enable_lora=True, max_loras=2,
            max_lora_rank=4, speculative_config=NGRAM,
        )  # fmt: skip
    yield llm, loras, refs
    llm.shutdown()


def test_drafts_under_adapters_equal_hf_peft(served):
    llm, loras, refs = served
    names = [0, None, 1, 0]
    # each model's own looping prompt (its drafts often right), the last one under another
    cases = [looping_prompt(refs[n], NEW_TOKENS) for n in names[:3]]
    cases.append((cases[1][0], _greedy(refs[0], cases[1][0])))  # the base's, adapter 0
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False,
        lora_request=[loras[n] for n in names],
    )  # fmt: skip
    for (_, want), name, out in zip(cases, names, outs):
        assert out.outputs[0].token_ids == want, name
    for i in range(3):  # each model's looping prompt had drafts accepted
        assert outs[i].metrics.num_accepted_tokens >= 3, names[i]
    assert cases[3][1] != cases[1][1]  # the adapter changes the base model's continuation


def _greedy(model, prompt: list[int]) -> list[int]:
    return hf_generate_greedy(model, [prompt], NEW_TOKENS)[0]


def test_steps_with_and_without_adapter_rows_take_the_cpu_decoder_loop(served, monkeypatch):
    """The C++ one-call decoder adds the LoRA deltas itself (`csrc/lora_cpu.cpp`, the kernel
    the layers call too): steps of an adapter's request and of base-model requests both run
    in the loop, and their ids stay HF + PEFT's and HF's."""
    from pagellm.layers.cpu_decoder import CpuDecoder

    llm, loras, refs = served
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    if runner.model.model.cpu_decoder is None:
        pytest.skip("no C++ decoder loop on this machine (compiler, AVX2 / AVX-512)")
    calls = []
    loop = CpuDecoder.__call__

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return loop(self, *args)

    monkeypatch.setattr(CpuDecoder, "__call__", counted)
    prompt = looping_prompt(refs[None], NEW_TOKENS)[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    adapted = llm.generate({"prompt_token_ids": prompt}, params, lora_request=loras[1])[0]
    assert len(calls) >= 2  # the adapter's prefill and decode steps
    del calls[:]
    base = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(calls) >= 2
    assert base.outputs[0].token_ids == _greedy(refs[None], prompt)
    assert adapted.outputs[0].token_ids == _greedy(refs[1], prompt) != base.outputs[0].token_ids
