"""LoRA adapters over quantized base weights, the delta added on top of the quantized layer's
output: the embedded SmolLM2 (GGUF) in float32, and tiny int4 (GPTQ, AWQ, compressed-tensors:
the int weights kept on the CPU's block kernel) and fp8 (block-scaled; dequantized at load on
the CPU) checkpoints, each with an adapter made here with `peft` (A and B random) on HF's model
of the dequantized weights; greedy ids (and, int4 / fp8, each token's logprob) equal HF +
PEFT's, an adapter request and a base-model request in one call."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import PROMPTS, hf_greedy
from safetensors.torch import load_file, save_file
from wna16_pack import Packing, quantize_folder

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


# ---------------------------------------------------------------- int4 and fp8 checkpoints

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
QUANTIZED = {  # case -> (family, format, the adapter's targets)
    "llama-gptq-sym-g32": ("llama", Packing("gptq", 4, 32), ["q_proj", "v_proj", "down_proj"]),
    "phi3-awq-asym-g32": ("phi3", Packing("awq", 4, 32, False), ["qkv_proj", "gate_up_proj"]),
    "qwen2-ct-asym-g32-actorder": (
        "qwen2", Packing("compressed-tensors", 4, 32, False, True), ["k_proj", "o_proj", "up_proj"]
    ),
    "llama-fp8-block": ("llama", "fp8", ["q_proj", "o_proj", "gate_proj"]),
}  # fmt: skip
# a logprob of ours against HF + PEFT's on the dequantized weights: the int4 block kernel sums
# in another order than a float matmul (test_quantization_wna16.py: logits within 1e-4)
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", params=list(QUANTIZED))
def quantized(request, tmp_path_factory):
    """(engine on the quantized folder, the adapter, HF + PEFT on the dequantized weights)."""
    from lora_utils import make_peft_adapter
    from model_utils import hf_model, make_tiny_hf_model

    family, packing, targets = QUANTIZED[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    # fp8 blocks of 128 rows: each of q, k, v 128 rows (test_quantization_fp8.py's shapes)
    shapes = dict(TINY, num_attention_heads=2) if packing == "fp8" else TINY
    folder = make_tiny_hf_model(family, tmp, std=0.1, **shapes)
    reference = str(tmp / "reference")
    if packing == "fp8":
        from test_quantization_fp8 import _write_fp8_checkpoint

        shutil.copytree(folder, reference)
        state = load_file(f"{reference}/model.safetensors")
        save_file(state | _write_fp8_checkpoint(folder, "block"), f"{reference}/model.safetensors")
    else:
        quantize_folder(folder, reference, packing)
    config = dict(r=8, lora_alpha=16, target_modules=targets)
    path, ref = make_peft_adapter(hf_model(reference), config, tmp / "adapter", seed=3, std=0.1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(folder, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8)
    yield llm, LoRARequest("q", 1, path), ref, hf_model(reference)
    llm.shutdown()


def test_adapter_over_int4_and_fp8_weights_equals_hf_peft(quantized):
    """The adapter's delta added over the quantized layer's output: greedy ids, and each
    token's logprob within LOGPROB_TOL, equal HF + PEFT's on the dequantized base."""
    llm, lora, ref, base_ref = quantized
    quant = llm.llm_engine.config.model_config.quantization
    assert quant in ("gptq", "awq", "compressed-tensors", "fp8"), quant
    core = llm.llm_engine.engine_core.engine_core  # in this process
    qkv = core.model_executor.driver_worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    kept = type(qkv.packed_weight).__name__  # int4: kept as ints; fp8: dequantized on the CPU
    floats = ("NoneType", "PackedWeight")
    assert (kept in floats if quant == "fp8" else kept == "WNA16BlockWeight") and qkv.lora, kept
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [[3, 17, 99, 250, 7, 41], [5, 60, 8, 301, 22, 9, 14]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=[lora, None],
    )  # fmt: skip
    tuned = hf_greedy(ref, prompts[0], NEW_TOKENS)
    base = hf_greedy(base_ref, prompts[1], NEW_TOKENS)
    base_tuned_prompt = hf_greedy(base_ref, prompts[0], NEW_TOKENS)
    got = outs[0].outputs[0]
    assert got.token_ids == tuned != base_tuned_prompt
    assert outs[1].outputs[0].token_ids == base
    with torch.inference_mode():
        ids = torch.tensor([prompts[0] + tuned])
        logprobs = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
    for i, (token, step) in enumerate(zip(got.token_ids, got.logprobs)):
        want = logprobs[len(prompts[0]) - 1 + i, token].item()
        assert step[token].logprob == pytest.approx(want, abs=LOGPROB_TOL), i
