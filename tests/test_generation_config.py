"""generation_config.json as vLLM's generation_config="auto" reads it: default sampling params
(LLM and server), every EOS id of its list ends a request, and min_tokens bans every EOS id
and stop token id, also with ignore_eos (HF's min_new_tokens), compared with HF generate."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_greedy
from model_utils import make_tiny_hf_model
from transformers import AutoModelForCausalLM, GenerationConfig

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.engine.input_processor import eos_token_ids

pytest.importorskip("fastapi")  # the server's extra (a GPU machine may lack it)
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from pagellm.entrypoints.openai.serving_engine import OpenAIServing  # noqa: E402

PROMPTS = [[5, 99, 300, 17, 42, 8], [250, 3, 77, 410, 11]]
NEW = 32
DEFAULTS = dict(temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny checkpoint whose generation config names a second EOS id: a token that greedy
    decoding of the first prompt produces at step k (k >= 3), not earlier."""
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("gen"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    k = next(i for i in range(3, NEW) if refs[0][i] not in refs[0][:i] + [2])
    second_eos = refs[0][k]
    config = {**DEFAULTS, "max_new_tokens": 9, "eos_token_id": [2, second_eos]}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return SimpleNamespace(folder=folder, hf=hf, refs=refs, k=k, eos=[2, second_eos])


@pytest.fixture(scope="module")
def llm(case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        engine = LLM(case.folder, dtype="float32", block_size=4, num_gpu_blocks_override=128)
    yield engine
    engine.shutdown()


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
    return tokens[: end + 1]


def test_defaults_come_from_the_generation_config(case, llm, caplog):
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS, max_tokens=9)
    out = llm.generate(_ids(PROMPTS[:1]), use_tqdm=False)[0].outputs[0]  # no params: defaults
    assert len(out.token_ids) == 9 or out.token_ids[-1] in case.eos
    with caplog.at_level(logging.INFO, logger="pagellm.loader.generation_config"):
        config = EngineArgs(model=case.folder).create_engine_config().model_config
    assert config.default_sampling_params == {**DEFAULTS, "max_tokens": 9}
    assert config.eos_token_ids == case.eos
    assert "generation_config.json" in caplog.text and str(case.eos) in caplog.text
    neutral = EngineArgs(model=case.folder, generation_config="vllm").create_engine_config()
    assert neutral.model_config.default_sampling_params == {}
    assert eos_token_ids(neutral.model_config, None) == [2]  # config.json's only


def test_every_eos_id_stops(case, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW)
    outs = llm.generate(_ids(PROMPTS), greedy, use_tqdm=False)
    first = outs[0].outputs[0]
    assert first.token_ids == case.refs[0][: case.k + 1]  # stopped by the second EOS id
    assert first.finish_reason == "stop" and first.stop_reason is None
    assert outs[1].outputs[0].token_ids == _until_eos(case.refs[1], case.eos)
    ignoring = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(_ids(PROMPTS), ignoring, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case.refs


def _hf_min_new_tokens(case, prompt: list[int], min_new: int, eos: list[int]) -> list[int]:
    config = GenerationConfig(
        do_sample=False, max_new_tokens=NEW, min_new_tokens=min_new, eos_token_id=eos
    )
    config.pad_token_id = 0
    with torch.inference_mode():
        out = case.hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def test_min_tokens_bans_every_eos_and_stop_id_also_with_ignore_eos(case, llm):
    """HF's min_new_tokens bans every EOS id; its output (which stops at the first EOS after
    that) must begin ours, which ignores EOS; our stop token id is one of HF's EOS ids."""
    min_tokens = case.k + 4
    stop_id = case.refs[1][2] if case.refs[1][2] not in case.eos else case.refs[1][3]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=NEW,
        min_tokens=min_tokens,
        ignore_eos=True,
        stop_token_ids=[stop_id],
    )
    outs = llm.generate(_ids(PROMPTS), params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0].token_ids
        assert not set(ours[:min_tokens]) & {*case.eos, stop_id}
        theirs = _hf_min_new_tokens(case, prompt, min_tokens, [*case.eos, stop_id])
        assert ours[: len(theirs)] == theirs
    assert outs[0].outputs[0].token_ids[: case.k] == case.refs[0][: case.k]
    assert outs[0].outputs[0].token_ids[case.k] != case.eos[1]  # banned at step k


def test_server_fills_what_a_request_leaves_out():
    defaults = {**DEFAULTS, "max_tokens": 9}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = chat.to_sampling_params(100, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.min_p) == (0.3, 7, 0.05)
    assert (params.top_p, params.repetition_penalty) == (0.5, 1.1)  # the request's top_p
    plain = chat.to_sampling_params(100, None)
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (1.0, 0, 1.0)
    engine = SimpleNamespace(tokenizer=None, config=SimpleNamespace(model_config=SimpleNamespace(
        max_model_len=64, default_sampling_params=defaults
    )))  # fmt: skip
    serving = OpenAIServing(engine, ["m"], metrics=None)
    assert serving.max_tokens(10, None) == 9  # max_new_tokens, within the room left
    assert serving.max_tokens(60, None) == 4
    assert serving.max_tokens(10, 20) == 20  # the request's own
