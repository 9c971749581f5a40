"""LoRA adapters on every dense family the engine serves, against HF + PEFT (float32, CPU).

Per family (Gemma 1/2/3, Phi-3, OLMo 2, SmolLM3, StarCoder2, Granite; Llama and Qwen3 are
tests/test_lora.py's), a tiny random base model (test_families.py's configs: windows, soft-caps,
NoPE layers, longrope, multipliers) and two PEFT adapters made here under the module names
PEFT finds in HF's model of that family (Phi-3's fused `qkv_proj` / `gate_up_proj`,
StarCoder2's `c_fc` / `c_proj`): one on the attention, one on the MLP. One `generate` mixes
both and a base-model request; each greedy id list equals HF + PEFT's. An adapter for a module
the family does not have (a Llama `gate_proj` on StarCoder2) is an error naming it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from lora_utils import assert_mixed_equal_hf_peft, make_peft_adapter
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model, save_tiny_tokenizer
from safetensors.torch import load_file, save_file
from test_families import FAMILIES

from pagellm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

LLAMA_NAMES = (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"])
TARGETS = {  # family -> (attention targets, MLP targets): HF's module names
    "phi3": (["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"]),
    "starcoder2": (LLAMA_NAMES[0], ["c_fc", "c_proj"]),
}
# Gemma 2 / 3's tiny models repeat one token at test_families.py's weights, whatever an
# attention adapter adds: smaller weights, outputs that follow the adapter
BASE_STD = {"gemma2": 0.3, "gemma3": 0.2}
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT_LENGTHS = (9, 21, 14)
ASSIGNED = (None, "attn", "mlp")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    """(engine, {name: LoRARequest}, {name or None: HF reference})."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    folder = make_tiny_hf_model(name, tmp, **{**FAMILIES[name], **_std(name)})
    save_tiny_tokenizer(folder)
    attn, mlp = TARGETS.get(name, LLAMA_NAMES)
    configs = {
        "attn": dict(r=4, lora_alpha=8, target_modules=attn),
        "mlp": dict(r=2, lora_alpha=4, target_modules=mlp, use_rslora=True),
    }
    refs, loras = {None: hf_model(folder)}, {}
    for i, (lora, config) in enumerate(configs.items()):
        path, refs[lora] = make_peft_adapter(folder, config, tmp / lora, seed=i, std=0.5)
        loras[lora] = LoRARequest(lora, i + 1, path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            folder, dtype="float32", block_size=4, num_gpu_blocks_override=48,
            max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=4,
        )  # fmt: skip
    yield name, llm, loras, refs
    llm.shutdown()


def _std(name: str) -> dict:
    return {"std": BASE_STD[name]} if name in BASE_STD else {}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_family_adapters_equal_hf_peft(served):
    name, llm, loras, refs = served
    assert_mixed_equal_hf_peft(llm, _prompts(), ASSIGNED, loras, refs, NEW_TOKENS, name)


def test_module_the_family_lacks_is_named(served, tmp_path):
    """StarCoder2's MLP is c_fc / c_proj: an adapter renamed to Llama's gate_proj fails alone
    with the module's name and the targets there are; the engine then serves the others."""
    name, llm, loras, refs = served
    if name != "starcoder2":
        pytest.skip("one family is enough")
    shutil.copytree(loras["mlp"].lora_path, tmp_path / "bad")
    file = tmp_path / "bad" / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file({k.replace("c_fc", "gate_proj"): v for k, v in tensors.items()}, file)
    config = tmp_path / "bad" / "adapter_config.json"  # an adapter made for a Llama-like MLP
    config.write_text(config.read_text().replace('"c_fc"', '"gate_proj"'))
    bad = LoRARequest("bad", 9, str(tmp_path / "bad"))
    prompt = _prompts()[0]
    with pytest.raises(ValueError, match=r"no mlp\.gate_proj in layers\.0 .*mlp\.c_fc"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=bad)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                       lora_request=loras["mlp"])  # fmt: skip
    assert out[0].outputs[0].token_ids == hf_generate_greedy(refs["mlp"], [prompt], NEW_TOKENS)[0]


def test_families_without_dense_targets_are_refused(tmp_path):
    """An MoE family's experts take no adapters: enable_lora is a start-up error naming it."""
    from pagellm import EngineArgs

    folder = make_tiny_hf_model("mixtral", tmp_path, num_local_experts=4, num_experts_per_tok=2)
    args = EngineArgs(model=folder, device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match="MixtralForCausalLM is not one of them"):
        args.create_engine_config()


def test_multimodal_gemma3_checkpoint_takes_language_model_adapters(tmp_path, monkeypatch):
    """Most Gemma 3 checkpoints are Gemma3ForConditionalGeneration: an adapter on its
    language model's layers (PEFT's keys under `model.language_model.`) gives HF + PEFT's
    greedy ids; one that also targets the vision tower is an error naming a tower module."""
    from model_utils import TINY_CONFIG, _randomize
    from test_families import _GEMMA
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

    text = Gemma3TextConfig(**{**TINY_CONFIG, **_GEMMA, **FAMILIES["gemma3"]})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    hf = Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(hf, 0.1, 0)  # at larger weights its outputs repeat one token, whatever adapter
    hf.save_pretrained(tmp_path / "mm")
    save_tiny_tokenizer(tmp_path / "mm")
    folder = str(tmp_path / "mm")
    language = dict(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|o_proj|up_proj|down_proj)"
    )
    path, ref = make_peft_adapter(hf_model(folder), language, tmp_path / "lm", seed=1, std=0.5)
    tower = dict(r=4, lora_alpha=8, target_modules=["q_proj"])  # the tower's q_proj too
    both, _ = make_peft_adapter(hf_model(folder), tower, tmp_path / "both", seed=2)
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    with LLM(folder, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=4) as llm:
        refs, loras = {None: hf_model(folder), 0: ref}, {0: LoRARequest("lm", 1, path)}
        assert_mixed_equal_hf_peft(llm, _prompts()[:2], [0, None], loras, refs, NEW_TOKENS)
        with pytest.raises(ValueError, match=r"vision_tower.* is not supported"):
            llm.generate("hi", lora_request=LoRARequest("both", 2, both), use_tqdm=False)


def test_adapter_of_the_other_fused_layout_is_refused(tmp_path):
    """Llama and Phi-3 of one shape: our layers fuse q | k | v and gate | up in both, but HF's
    Llama has q_proj ... and no qkv_proj, HF's Phi-3 the reverse. A Phi-3 adapter on Llama:
    HF + PEFT applies only its o_proj / down_proj (it ignores qkv_proj / gate_up_proj); here
    an error naming the module, and the engine serves a Llama adapter on. Likewise a Llama
    adapter on Phi-3."""
    import peft

    llama = make_tiny_hf_model("llama", tmp_path, std=0.3)
    phi3 = make_tiny_hf_model("phi3", tmp_path, std=0.3)
    for folder in (llama, phi3):
        save_tiny_tokenizer(folder)
    on_phi3, _ = make_peft_adapter(phi3, dict(r=4, lora_alpha=8, target_modules=[
        "qkv_proj", "gate_up_proj", "o_proj"]), tmp_path / "phi3_adapter", seed=1)  # fmt: skip
    on_llama, ref = make_peft_adapter(llama, dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "up_proj", "o_proj"]), tmp_path / "llama_adapter", seed=2)  # fmt: skip
    crossed = peft.PeftModel.from_pretrained(hf_model(llama), on_phi3)
    assert not any("qkv_proj" in n for n, _ in crossed.named_modules())  # PEFT ignores them
    prompt = _prompts()[0]
    for base, good, bad, missing in ((llama, on_llama, on_phi3, "qkv_proj|gate_up_proj"),
                                     (phi3, on_phi3, on_llama, "q_proj|up_proj")):  # fmt: skip
        with LLM(base, dtype="float32", max_model_len=64, enable_lora=True,
                 max_lora_rank=4) as llm:  # fmt: skip
            with pytest.raises(ValueError, match=rf"no (self_attn|mlp)\.({missing}) in layers\.0"):
                llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("bad", 1, bad))  # fmt: skip
            out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("good", 2, good))  # fmt: skip
            if base == llama:
                assert (
                    out[0].outputs[0].token_ids == hf_generate_greedy(ref, [prompt], NEW_TOKENS)[0]
                )
