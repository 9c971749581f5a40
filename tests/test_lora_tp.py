"""LoRA with tensor parallelism on the CPU (gloo, a worker process per rank): each rank holds
its cut of every adapter, A or B sharded as the base layer is (column-parallel: B by output
rows, each fused part's own; row-parallel: A by input columns, each rank's partial delta
summed by the layer's own all-reduce). Two ranks give HF + PEFT's greedy ids, adapters and
the base model mixed in one call: a Llama with one KV head (k / v replicated on both ranks)
and biases, and Phi-3 with adapters on its fused qkv_proj / gate_up_proj (B split into its
parts, then each part cut)."""

from __future__ import annotations

import pytest
import torch
from lora_utils import assert_mixed_equal_hf_peft, make_peft_adapter
from model_utils import hf_model, make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM, LoRARequest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {  # family -> (config overrides, two adapters' targets)
    "llama": (dict(num_key_value_heads=1, attention_bias=True), (ALL, ["v_proj", "down_proj"])),
    "phi3": (dict(pad_token_id=0), (["qkv_proj", "down_proj"], ["o_proj", "gate_up_proj"])),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    name = request.param
    overrides, targets = FAMILIES[name]
    tmp = tmp_path_factory.mktemp(name)
    folder = make_tiny_hf_model(name, tmp, std=0.3, **overrides)
    save_tiny_tokenizer(folder)
    refs, loras = {None: hf_model(folder)}, {}
    for i, modules in enumerate(targets):
        config = dict(r=4, lora_alpha=8, target_modules=modules)
        path, refs[i] = make_peft_adapter(folder, config, tmp / f"a{i}", seed=i)
        loras[i] = LoRARequest(f"a{i}", i + 1, path)
    llm = LLM(
        folder, dtype="float32", max_model_len=128, tensor_parallel_size=2,
        kv_cache_memory_bytes=1 << 22, enable_lora=True, max_loras=2, max_lora_rank=4,
    )  # fmt: skip
    yield llm, loras, refs
    llm.shutdown()


def test_two_ranks_equal_hf_peft(served):
    llm, loras, refs = served
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 500, (n,), generator=gen).tolist() for n in (11, 23, 17)]
    assert_mixed_equal_hf_peft(llm, prompts, [0, None, 1], loras, refs, NEW_TOKENS)
