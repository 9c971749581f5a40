"""End to end on the GPU: our engine against HF transformers, same config, same weights, bf16.

For Qwen3 (head_dim 128), Llama (head_dim 64), the MoE families Qwen3-MoE and Mixtral
(8 experts, top-2: the fused-MoE Triton kernels), and Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2,
Granite, SmolLM3, StarCoder2 with their quirks (sliding windows, soft-caps, yarn, longrope,
partial rotary, multipliers, NoPE layers, LayerNorms), three layers each, an HF model is
built from its config, trained for a few hundred steps on a synthetic language (a random
block of PERIOD tokens repeated, so predicting a token means attending PERIOD - 1 positions
back), saved in bf16 with `save_pretrained`, and loaded by our engine from that folder.

Why train: with untrained random weights the top two logits are near-ties, and two correct
bf16 implementations pick different argmaxes within a few tokens (measured on the CPU:
16-50% of 32-token continuations identical, between HF in bf16 and HF in fp32 or ours in
bf16). A trained model's margins sit well above bf16 rounding, as a real checkpoint's do, so
the comparison tests our kernels and not the coin flips.

Checks: prefill logits (our model over the paged cache vs HF's forward) within bf16
tolerance, and greedy continuations of 32 tokens for 64 prompts through `LLM.generate`
(CUDA graphs on) identical for >= 90% of prompts; the rate and the first divergence
positions are printed (run with `-s`). `PAGELLM_E2E_DEVICE=cpu` runs the same checks on the
CPU (slow: ~10 minutes a family on 2 cores).

Known gap: Mixtral's trained model is not far enough from bf16's coin flips. Its router's
near-tied experts flip under bf16 rounding: on the CPU, HF bf16's prefill logits were up to
11% from HF float32's on the same weights and its continuations 89-91% identical to them,
as ours are to HF bf16's (87.5-90.6%), so its 2% / 90% bars fail for ours and would for HF.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from model_utils import load_our_model, run_paged
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GraniteConfig,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    Starcoder2Config,
)

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("PAGELLM_E2E_DEVICE", "cuda")
VOCAB, PERIOD, TRAIN_LEN = 1024, 7, 192
NUM_PROMPTS, NUM_NEW = 64, 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
GEMMA = dict(
    COMMON,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=64,
    final_logit_softcapping=30.0,
    pad_token_id=0,
)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=128
    ),
    "llama": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
    ),
    "mixtral": lambda: MixtralConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # the families of issue 13, their quirks on: windows (64) shorter than most prompts,
    # soft-caps, yarn on Gemma 3's global layers, Phi-3's longrope crossing its original
    # length (128) and partial rotary, OLMo 2's norms
    "gemma": lambda: GemmaConfig(
        **{k: v for k, v in GEMMA.items() if k != "query_pre_attn_scalar"}
    ),
    "gemma2": lambda: Gemma2Config(**GEMMA, attn_logit_softcapping=50.0),
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 128,
            },
        },
    ),  # fmt: skip
    "phi3": lambda: Phi3Config(
        **{**COMMON, "max_position_embeddings": 512},
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        sliding_window=64,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(24)],
            "long_factor": [1.0 + 0.2 * i for i in range(24)],
        },
    ),  # fmt: skip
    "olmo2": lambda: Olmo2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "smollm3": lambda: SmolLM3Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layer_interval=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "starcoder2": lambda: Starcoder2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=64, use_bias=True
    ),
    "granite": lambda: GraniteConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        embedding_multiplier=6.0,
        attention_multiplier=0.03,
        residual_multiplier=0.4,
        logits_scaling=4.0,
    ),
}


def periodic_tokens(rng: torch.Generator, n: int, length: int) -> torch.Tensor:
    """[n, length] sequences: a random block of PERIOD tokens (ids >= 3), repeated."""
    block = torch.randint(3, VOCAB, (n, PERIOD), generator=rng)
    return block.repeat(1, -(-length // PERIOD))[:, :length]


def train(arch: str, steps: int, device: str) -> torch.nn.Module:
    """An HF model trained to continue the period; fp32, on `device`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = periodic_tokens(rng, 64, TRAIN_LEN).to(device)
        labels = ids.clone()
        labels[:, :PERIOD] = -100  # the first block is unpredictable
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"\n{arch}: trained {steps} steps, final loss {loss.item():.4f}")
    return model.eval()


def prompts(seed: int = 1) -> list[list[int]]:
    """64 periodic prompts of 9..150 tokens (crossing several 16-token KV blocks)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [
        periodic_tokens(gen, 1, rng.randint(PERIOD + 2, 150))[0].tolist()
        for _ in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module", params=list(CONFIGS))
def trained(request, tmp_path_factory):
    """(arch, saved bf16 folder, HF bf16 model on the device)."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = int(os.environ.get("PAGELLM_E2E_TRAIN_STEPS", "300"))
    model = train(request.param, steps, DEVICE).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    yield request.param, str(folder), model
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_prefill_logits_match_hf(trained):
    from pagellm.attention.selector import get_attn_backend_cls

    arch, folder, hf = trained
    backend = get_attn_backend_cls(DEVICE)
    ours = load_our_model(folder, torch.bfloat16, device=DEVICE, attn_backend_cls=backend)
    batch = prompts(seed=2)[:8]
    results = run_paged(ours, batch, num_decode_steps=0, chunk_size=40)
    for prompt, (_, logits) in zip(batch, results):
        with torch.inference_mode():
            ref = hf(input_ids=torch.tensor([prompt], device=DEVICE)).logits[0].float().cpu()
        rel = ((logits - ref).norm() / ref.norm()).item()
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert rel < 2e-2, f"{arch}: prefill logits differ from HF by {rel:.3e} (relative)"
        assert agree > 0.95, f"{arch}: argmax agrees at only {agree:.0%} of positions"


def test_greedy_continuations_match_hf(trained, monkeypatch):
    from pagellm import LLM, SamplingParams

    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    arch, folder, hf = trained
    batch = prompts()
    expected = [hf_greedy(hf, p) for p in batch]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(
        model=folder,
        dtype="bfloat16",
        device=DEVICE,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=64,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    first = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        for x, y in zip(got, expected)
    ]
    rate = sum(f is None for f in first) / len(batch)
    print(f"\n{arch}: {rate:.1%} of {len(batch)} greedy continuations identical to HF; "
          f"first divergence positions: {[f for f in first if f is not None]}")  # fmt: skip
    assert rate >= 0.9
