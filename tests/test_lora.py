"""LoRA adapters against HF + PEFT (float32, CPU), end to end through the engine process.

Per family (Llama, Qwen3), a tiny random base model and three PEFT adapters made here with
`peft` (A and B both random: PEFT starts B at zero), of other ranks, targets, alpha and rsLoRA.
One `generate` mixes base-model requests and the three adapters over two slots and a host
cache of two (so adapters are evicted from both), with chunked prefill and a KV budget small
enough to preempt; each request's greedy ids equal HF + PEFT's. The prefix cache keys
blocks by adapter. A bad adapter (a module's shape, a rank over max_lora_rank, a module the
base model has not) fails alone with an error naming it; the engine then serves the others.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from lora_utils import make_peft_adapter
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model, save_tiny_tokenizer
from safetensors.torch import load_file, save_file

from pagellm import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")
# peft 0.21 asks transformers a deprecated question when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "attn": dict(r=4, lora_alpha=8, target_modules=ATTN),
    "mlp_rs": dict(r=8, lora_alpha=4, target_modules=[*MLP, "q_proj"], use_rslora=True),
    "all": dict(r=2, lora_alpha=6, target_modules=ATTN + MLP),
}
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT_LENGTHS = (7, 19, 33, 45, 12, 26)
# per prompt: its adapter (None: the base model)
ASSIGNED = (None, "attn", "mlp_rs", "all", "attn", None)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def served(request, tmp_path_factory):
    """(engine, {name: LoRARequest}, {name or None: HF reference model}, adapter folder)."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_hf_model(request.param, tmp, std=0.3)
    save_tiny_tokenizer(folder)
    refs, loras = {None: hf_model(folder)}, {}
    for i, name in enumerate(ADAPTERS):
        path, refs[name] = make_peft_adapter(folder, ADAPTERS[name], tmp / name, seed=10 + i)
        loras[name] = LoRARequest(name, i + 1, path)
    llm = LLM(
        folder, dtype="float32", block_size=4, num_gpu_blocks_override=24,
        max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=8,
        max_cpu_loras=2,
    )  # fmt: skip
    yield llm, loras, refs, tmp
    llm.shutdown()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _expected(refs, prompt: list[int], name: str | None) -> list[int]:
    return hf_generate_greedy(refs[name], [prompt], NEW_TOKENS)[0]


def test_mixed_adapters_equal_hf_peft(served):
    """Base and three adapters in one call (two slots: evictions), chunked and preempted."""
    llm, loras, refs, _ = served
    prompts = _prompts()
    requests = [{"prompt_token_ids": p} for p in prompts]
    lora_list = [None if n is None else loras[n] for n in ASSIGNED]
    outputs = llm.generate(requests, GREEDY, use_tqdm=False, lora_request=lora_list)
    assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    for prompt, name, out in zip(prompts, ASSIGNED, outputs):
        expected = _expected(refs, prompt, name)
        assert out.outputs[0].token_ids == expected, (len(prompt), name)
        assert out.lora_request == (None if name is None else loras[name])
        if name is not None:  # the adapter changes the output
            assert expected != _expected(refs, prompt, None), name


def test_a_config_narrower_than_its_weights_is_read_as_peft_reads_it(served, tmp_path):
    """PEFT puts LoRA layers where the config says (`target_modules`, `layers_to_transform`)
    and loads only their weights: a file with more (the "all" adapter, its config narrowed to
    q_proj and v_proj of layer 1) is served as HF + PEFT serve it."""
    from model_utils import hf_model
    from peft import PeftModel

    llm, loras, _, _ = served
    copy = shutil.copytree(loras["all"].lora_path, tmp_path / "narrowed")
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    (copy / "adapter_config.json").write_text(json.dumps(config))
    base = hf_model(config["base_model_name_or_path"])
    ref = PeftModel.from_pretrained(base, str(copy)).base_model.model.eval()
    prompt = _prompts()[1]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("narrowed", 7, str(copy)))[0]  # fmt: skip
    expected = hf_generate_greedy(ref, [prompt], NEW_TOKENS)[0]
    assert out.outputs[0].token_ids == expected
    whole = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                         lora_request=loras["all"])[0]  # fmt: skip
    assert whole.outputs[0].token_ids != expected  # the dropped weights mattered


@pytest.mark.parametrize("rslora", [False, True])
def test_rank_and_alpha_patterns_equal_hf_peft(served, tmp_path, rslora):
    """PEFT's `rank_pattern` / `alpha_pattern` (regex keys ending a module's name, the first
    that matches wins) give some modules their own rank and alpha: served in one slot of the
    largest rank, each module's own scale; the ids equal HF + PEFT's, and an adapter without
    the patterns (same seed) gives others."""
    llm, _, refs, _ = served
    config = dict(
        r=4, lora_alpha=8, target_modules=ATTN + MLP, use_rslora=rslora,
        rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 1, "up_proj": 2},
        alpha_pattern={"v_proj": 32, r"model\.layers\.0\.self_attn\.o_proj": 0.5},
    )  # fmt: skip
    base = hf_model(llm.llm_engine.config.model_config.model)
    path, ref = make_peft_adapter(base, config, tmp_path / "patterns", seed=40)
    assert ref.model.layers[0].self_attn.q_proj.lora_A["default"].weight.shape[0] == 8
    prompts = _prompts()[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("patterns", 80 + rslora, path))  # fmt: skip
    plain = {k: v for k, v in config.items() if not k.endswith("_pattern")}
    _, flat = make_peft_adapter(hf_model(llm.llm_engine.config.model_config.model), plain,
                                tmp_path / "plain", seed=40)  # fmt: skip
    for prompt, out in zip(prompts, outs):
        want = hf_generate_greedy(ref, [prompt], NEW_TOKENS)[0]
        assert out.outputs[0].token_ids == want
        assert want != hf_generate_greedy(flat, [prompt], NEW_TOKENS)[0]


def test_config_rank_every_pattern_replaces_is_not_checked(served, tmp_path):
    """Rank-reduction tools write a nominal `r` (here over max_lora_rank, or 0) and give every
    module its rank in `rank_pattern`: PEFT builds only the patterns' ranks, and so do we."""
    llm, _, _, _ = served
    prompt = _prompts()[2]
    for r, name in ((32, "nominal32"), (0, "nominal0")):
        config = dict(r=r, lora_alpha=16, target_modules=ATTN + MLP,
                      rank_pattern={"self_attn.*": 8, "mlp.*": 4})  # fmt: skip
        base = hf_model(llm.llm_engine.config.model_config.model)
        path, ref = make_peft_adapter(base, config, tmp_path / name, seed=50 + r)
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest(name, 100 + r, path))  # fmt: skip
        assert out[0].outputs[0].token_ids == hf_generate_greedy(ref, [prompt], NEW_TOKENS)[0]


def test_a_pattern_rank_over_max_or_malformed_is_refused(served, tmp_path):
    llm, loras, _, _ = served
    folder = tmp_path / "odd"
    shutil.copytree(loras["all"].lora_path, folder)  # r=2
    config = json.loads((folder / "adapter_config.json").read_text())
    cases = (({"rank_pattern": {"q_proj": 16}}, "rank 16 is over max_lora_rank=8"),
             ({"rank_pattern": {"q_proj": 3}}, "needs A (3, "),
             ({"alpha_pattern": {"q_proj": "4"}}, "alpha_pattern['q_proj']='4'"),
             ({"rank_pattern": {"(q_proj": 2}}, "rank_pattern key '(q_proj'"))  # fmt: skip
    for edit, words in cases:
        (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=re.escape(words)):
            llm.generate("hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("odd", 90, str(folder)))  # fmt: skip


def test_hub_id_resolves_to_the_cached_snapshot(served, tmp_path, monkeypatch):
    """A `lora_path` that is no folder but a Hub id (`org/name`) is resolved as models are:
    the Hugging Face cache's snapshot (offline here), read by the engine core from there; an
    id in neither is a ValueError naming it, and the engine serves on."""
    import huggingface_hub.constants
    from model_utils import fake_hub_snapshot

    llm, loras, refs, _ = served
    cache = tmp_path / "hub"
    fake_hub_snapshot(cache, "org/attn-adapter", loras["attn"].lora_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no folder org/attn-adapter here
    prompt = _prompts()[1]
    hub = LoRARequest("hub", 120, "org/attn-adapter")
    for _ in range(2):  # the second time from the resolved folder, checked once
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=hub)
        assert out[0].outputs[0].token_ids == _expected(refs, prompt, "attn")
    assert hub.lora_path == "org/attn-adapter"  # the caller's request is left as given
    with pytest.raises(ValueError, match="org/missing-adapter"):
        llm.generate("hi", GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("missing", 121, "org/missing-adapter"))  # fmt: skip
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                       lora_request=loras["all"])  # fmt: skip
    assert out[0].outputs[0].token_ids == _expected(refs, prompt, "all")


def test_chat_and_streams_take_the_adapter(served):
    """`chat`, `generate_stream` and `chat_stream` under one adapter for every prompt: the ids
    of HF + PEFT on the prompt the engine tokenized."""
    from model_utils import GEMMA_CHAT_TEMPLATE

    llm, loras, refs, _ = served
    messages = [{"role": "user", "content": "the cat"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=GEMMA_CHAT_TEMPLATE,
                    lora_request=loras["mlp_rs"])[0]  # fmt: skip
    want = _expected(refs, chat.prompt_token_ids, "mlp_rs")
    assert chat.outputs[0].token_ids == want != _expected(refs, chat.prompt_token_ids, None)
    deltas = list(llm.chat_stream(messages, GREEDY, chat_template=GEMMA_CHAT_TEMPLATE,
                                  lora_request=loras["mlp_rs"]))  # fmt: skip
    assert [t for d in deltas for t in d.outputs[0].token_ids] == want
    prompt = _prompts()[0]
    final = list(llm.generate_stream({"prompt_token_ids": prompt}, GREEDY,
                                     lora_request=[loras["all"]]))[-1]  # fmt: skip
    assert final.outputs[0].token_ids == _expected(refs, prompt, "all")


def test_prefix_cache_keyed_by_adapter(served):
    """The same prompt again: a hit under the same adapter, none under another or the base
    model, and each output still its own model's."""
    llm, loras, refs, _ = served
    prompt = _prompts()[3]
    request = {"prompt_token_ids": prompt}
    first = llm.generate(request, GREEDY, use_tqdm=False, lora_request=loras["all"])[0]
    again = llm.generate(request, GREEDY, use_tqdm=False, lora_request=loras["all"])[0]
    other = llm.generate(request, GREEDY, use_tqdm=False, lora_request=loras["attn"])[0]
    base = llm.generate(request, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert (
        first.outputs[0].token_ids == again.outputs[0].token_ids == _expected(refs, prompt, "all")
    )
    assert other.outputs[0].token_ids == _expected(refs, prompt, "attn")
    assert base.outputs[0].token_ids == _expected(refs, prompt, None)
    # "attn" and the base model may have cached this prompt in the first test: compare with
    # a fresh adapter id over the same folder
    fresh = LoRARequest("attn-again", 9, loras["attn"].lora_path)
    cold = llm.generate(request, GREEDY, use_tqdm=False, lora_request=fresh)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == other.outputs[0].token_ids


def _broken_copy(good: str, dst, edit) -> str:
    """A copy of adapter `good` whose tensors `edit` changes."""
    shutil.copytree(good, dst)
    tensors = load_file(f"{dst}/adapter_model.safetensors")
    save_file(edit(tensors), f"{dst}/adapter_model.safetensors")
    return str(dst)


def _narrow_down_proj(tensors):
    return {
        k: (v[:, :-1].contiguous() if "down_proj.lora_A" in k else v) for k, v in tensors.items()
    }


def _add_embedding(tensors):
    key = next(iter(tensors)).split("layers.")[0] + "embed_tokens.lora_A.weight"
    return {**tensors, key: torch.zeros(2, 512)}


@pytest.mark.parametrize(
    "edit, words",
    [
        (_narrow_down_proj, "layers.0.mlp.down_proj has A (2, 127)"),
        (_add_embedding, "LoRA on the embeddings: 'base_model.model.model.embed_tokens"),
    ],
)
def test_bad_adapter_fails_alone(served, tmp_path, edit, words):
    llm, loras, refs, _ = served
    bad = LoRARequest("bad", 20, _broken_copy(loras["all"].lora_path, tmp_path / "bad", edit))
    prompt = _prompts()[0]
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=bad)
    out = llm.generate(
        [{"prompt_token_ids": prompt}] * 2, GREEDY, use_tqdm=False,
        lora_request=[loras["mlp_rs"], None],
    )  # fmt: skip
    assert out[0].outputs[0].token_ids == _expected(refs, prompt, "mlp_rs")
    assert out[1].outputs[0].token_ids == _expected(refs, prompt, None)


def test_core_fails_a_bad_adapter_alone(served, tmp_path, monkeypatch):
    """The caller's check skipped: the engine core's read of the adapter (before queueing)
    fails that request alone, and the engine serves the next."""
    llm, loras, refs, _ = served
    monkeypatch.setattr(llm.llm_engine.input_processor, "check_lora", lambda lora: lora)
    bad = LoRARequest(
        "bad", 22, _broken_copy(loras["all"].lora_path, tmp_path / "b", _add_embedding)
    )
    prompt = _prompts()[1]
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=bad)
    out = llm.generate(
        {"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=loras["attn"]
    )
    assert out[0].outputs[0].token_ids == _expected(refs, prompt, "attn")


def test_rank_over_max_and_lora_off(served, tmp_path):
    llm, loras, _, _ = served
    big = tmp_path / "big"
    shutil.copytree(loras["all"].lora_path, big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    with pytest.raises(ValueError, match="rank 16 is over max_lora_rank=8"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 21, str(big)))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[loras["all"]])
    from pagellm.engine.lora_check import LoRACheck

    with pytest.raises(ValueError, match="enable_lora=True"):
        LoRACheck(llm.llm_engine.config.model_config, None)(loras["all"])


def test_evicted_adapter_whose_folder_is_gone_fails_alone(served, tmp_path):
    """An adapter evicted from the host cache (two adapters there) whose folder was deleted
    since: its next request fails at admission with the folder's error, the engine serves on;
    one still cached is served from the cache."""
    llm, loras, refs, _ = served
    prompt = _prompts()[2]
    request = {"prompt_token_ids": prompt}
    gone = LoRARequest("gone", 30, str(shutil.copytree(loras["attn"].lora_path, tmp_path / "g")))
    first = llm.generate(request, GREEDY, use_tqdm=False, lora_request=gone)[0]
    assert first.outputs[0].token_ids == _expected(refs, prompt, "attn")
    for name in ("all", "mlp_rs"):  # the host cache holds these two now
        llm.generate(request, GREEDY, use_tqdm=False, lora_request=loras[name])
    shutil.rmtree(tmp_path / "g")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(request, GREEDY, use_tqdm=False, lora_request=gone)
    cached = LoRARequest("cached", 31, str(shutil.copytree(loras["all"].lora_path, tmp_path / "c")))
    llm.generate(request, GREEDY, use_tqdm=False, lora_request=cached)
    shutil.rmtree(tmp_path / "c")  # still in the host cache: served from it
    outs = llm.generate(
        [request] * 2, GREEDY, use_tqdm=False, lora_request=[cached, loras["mlp_rs"]]
    )
    assert outs[0].outputs[0].token_ids == _expected(refs, prompt, "all")
    assert outs[1].outputs[0].token_ids == _expected(refs, prompt, "mlp_rs")


def test_a_queued_requests_adapter_stays_cached_until_it_runs(served, tmp_path):
    """Requests of more adapters than the host cache holds, all queued before a step: adding
    the later ones must not evict an earlier queued request's adapter (a step never reads a
    folder: this one is deleted before the first step)."""
    llm, loras, refs, _ = served
    engine, prompt = llm.llm_engine, _prompts()[1]
    queued = LoRARequest(
        "queued", 40, str(shutil.copytree(loras["mlp_rs"].lora_path, tmp_path / "q"))
    )
    order = [loras["attn"], queued, loras["all"], loras["attn"], loras["all"]]
    for i, lora in enumerate(order):
        engine.add_request(f"q{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    engine.call_utility("get_stats")  # a round trip: the core has read every adapter
    shutil.rmtree(tmp_path / "q")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    names = {id(loras[n]): n for n in ADAPTERS} | {id(queued): "mlp_rs"}
    for i, lora in enumerate(order):
        assert done[f"q{i}"].outputs[0].token_ids == _expected(refs, prompt, names[id(lora)])


def test_max_lora_rank_is_at_most_512(tmp_path):
    from pagellm.config.lora import LoRAConfig

    with pytest.raises(ValueError, match="max_lora_rank must be in \\[1, 512\\]"):
        LoRAConfig(max_lora_rank=528)


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"init_lora_weights": "pissa_niter_4"}, "convert it to a plain LoRA adapter"),
        ({"init_lora_weights": "olora"}, "changes the base model's weights"),
        ({"layer_replication": [[1, 2], [0, 1]]}, "layer_replication"),
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "lora_bias"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
        ({"kasa_config": {"beta": 1e-4}}, "kasa_config"),
    ],
)
def test_configs_peft_loads_into_another_model_are_refused(served, tmp_path, edit, words):
    """PEFT changes the base model when it loads these (PiSSA / OLoRA subtract their initial
    A0 B0 from its weights, layer_replication re-stacks its layers) or adds more than A and B:
    the adapter alone on the unchanged base model would be another model."""
    llm, loras, _, _ = served
    folder = tmp_path / "odd"
    shutil.copytree(loras["attn"].lora_path, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=words):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("odd", 50, str(folder)))


def test_config_without_lora_alpha_takes_peft_default(served, tmp_path):
    llm, loras, refs, _ = served
    folder = tmp_path / "no_alpha"
    shutil.copytree(loras["all"].lora_path, folder)  # r=2, lora_alpha=6
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    base = hf_model(llm.llm_engine.config.model_config.model)
    ref = peft.PeftModel.from_pretrained(base, str(folder)).eval()  # PEFT's lora_alpha: 8
    prompt = _prompts()[4]
    out = llm.generate(
        {"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
        lora_request=LoRARequest("no-alpha", 51, folder),  # a pathlib.Path: its str is sent
    )  # fmt: skip
    want = hf_generate_greedy(ref, [prompt], NEW_TOKENS)[0]
    assert out[0].outputs[0].token_ids == want != _expected(refs, prompt, "all")
    with pytest.raises(ValueError, match="lora_int_id must be an int"):
        LoRARequest("flag", True, str(folder))


def test_activated_lora_is_refused_not_applied_to_every_token(served, tmp_path):
    """An activated LoRA (PEFT's alora_invocation_tokens) changes only the tokens from its
    invocation sequence on: with no invocation in the prompt HF + PEFT's ids are the base
    model's, while the same A and B applied to every token give other ids. Refused at load,
    the engine then serves the others."""
    llm, loras, refs, _ = served
    folder = tmp_path / "alora"
    shutil.copytree(loras["all"].lora_path, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(alora_invocation_tokens=[3, 4], task_type="CAUSAL_LM")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prompt = [t for t in _prompts()[0] if t not in (3, 4)]
    ref = peft.PeftModel.from_pretrained(hf_model(llm.llm_engine.config.model_config.model),
                                         str(folder)).eval()  # fmt: skip
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # fmt: skip
    assert want[0, len(prompt) :].tolist() == _expected(refs, prompt, None)  # PEFT: no invocation
    assert _expected(refs, prompt, "all") != _expected(refs, prompt, None)
    with pytest.raises(ValueError, match="alora_invocation_tokens"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("alora", 60, str(folder)))  # fmt: skip
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                       lora_request=loras["all"])  # fmt: skip
    assert out[0].outputs[0].token_ids == _expected(refs, prompt, "all")


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"r": None}, "r=None is not an integer rank"),
        ({"r": 2.5}, "r=2.5 is not an integer rank"),
        ({"r": "2"}, "r='2' is not an integer rank"),
        ({"lora_alpha": None}, "lora_alpha=None is not a number"),
        ({"lora_alpha": "6"}, "lora_alpha='6' is not a number"),
    ],
)
def test_malformed_rank_or_alpha_is_a_value_error_naming_it(served, tmp_path, edit, words):
    """PEFT cannot load these either; here a ValueError naming the adapter and the field (not
    a bare TypeError from int() / float(), nor a rank or alpha silently converted), and the
    engine serves on."""
    llm, loras, refs, _ = served
    folder = tmp_path / "malformed"
    shutil.copytree(loras["all"].lora_path, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    prompt = _prompts()[0]
    with pytest.raises(ValueError, match=re.escape(words)) as error:
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("malformed", 70, str(folder)))  # fmt: skip
    assert str(folder) in str(error.value)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                       lora_request=loras["all"])  # fmt: skip
    assert out[0].outputs[0].token_ids == _expected(refs, prompt, "all")
