"""A LoRA adapter over quantized base weights: the embedded SmolLM2 (GGUF) in float32, an
adapter made here with `peft` (A and B random) on HF's model of the same file; greedy ids equal
HF + PEFT's, an adapter request and a base-model request in one call."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_greedy

from pagellm import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
    # saving: peft looks for the base model's config.json beside a GGUF file, which has none
    pytest.mark.filterwarnings("ignore:Could not find a config file:UserWarning"),
]

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
CONFIG = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


def test_adapter_over_gguf_weights_equals_hf_peft(embedded_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, name = embedded_gguf
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = peft.get_peft_model(hf.eval(), peft.LoraConfig(**CONFIG))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(tmp_path / "adapter")
    lora = LoRARequest("tuned", 1, str(tmp_path / "adapter"))
    with LLM(dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8) as llm:
        assert llm.llm_engine.config.model_config.quantization == "gguf"
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        outs = llm.generate(
            [{"prompt_token_ids": ids}] * 2, GREEDY, use_tqdm=False, lora_request=[lora, None]
        )
    tuned = hf_greedy(model.base_model.model.eval(), ids, NEW_TOKENS)
    with model.disable_adapter():
        base = hf_greedy(model.base_model.model, ids, NEW_TOKENS)
    assert outs[0].outputs[0].token_ids == tuned != base
    assert outs[1].outputs[0].token_ids == base
