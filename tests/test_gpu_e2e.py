"""End to end on the GPU, judged as the project judges a family in bf16: pagellm in bf16 is
no further from HF in float32 than HF's own bf16 run is, on the same weights, in one test.

For Qwen3 (head_dim 128), Llama (head_dim 64), the MoE families Qwen3-MoE, Mixtral and
gpt-oss (8 experts, top-2: the fused-MoE Triton kernels; gpt-oss's sinks and biases too),
DeepSeek V2 and V3 (latent attention: the MLA decode kernel; grouped top-k with shared
experts), and Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite, SmolLM3, StarCoder2 with their
quirks (sliding windows, soft-caps, yarn, longrope, partial rotary, multipliers, NoPE layers,
LayerNorms), three layers each, an HF model is
built from its config, trained for a few hundred steps on a synthetic language (a random
block of PERIOD tokens repeated, so predicting a token means attending PERIOD - 1 positions
back) and saved in bf16. Three runs of that checkpoint:

- the reference: HF in float32 (`from_pretrained(dtype=float32)`: the bf16 weights exactly);
- the peer: HF's own bf16 run (`from_pretrained(dtype=bfloat16)`);
- ours: `LLM(folder, dtype="bfloat16")` (CUDA graphs on), and our model over the paged cache
  for prefill logits.

Checks, ours against the peer, both measured against the reference:
- prefill logits of 16 prompts (teacher-forced): relative distance at most PREFILL_SLACK times
  the peer's, argmax agreement at most ARGMAX_SLACK below the peer's;
- greedy continuations of NUM_NEW tokens for 64 prompts (HF: `generate`'s, Phi-3 switching to
  its long rope factors as transformers 5.25's does): the share identical to the reference,
  and the mean share of tokens before the first divergence, at most GREEDY_SLACK below the
  peer's.

Why train: with random weights the top two logits are near-ties and any bf16 run flips
them within a few tokens; a trained model's margins sit above bf16 rounding, as a real
checkpoint's do, so the comparison tests kernels and not coin flips. Mixtral's router still
has near-tied experts after training (HF bf16 flips ~10% of its continuations): judged
against HF's own bf16 run, that is the peer's noise too. The slacks are the sampling noise
of 64 continuations and 16 prompts (a binomial standard deviation is ~4 points at 90%), and
for logits the spread of correct bf16 implementations (below).
`PAGELLM_E2E_DEVICE=cpu` runs the same checks on the CPU (slow: minutes a family on 2
cores).
"""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import hf_generate_greedy, hf_model, load_our_model, run_paged
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GptOssConfig,
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
# sequences of both sides of Phi-3's original length (128): HF trains (and rotates) a longer
# one with its long rope factors, a shorter one with the short ones; a model that never saw
# one regime has near-tied logits there, which any bf16 run flips
VOCAB, PERIOD, TRAIN_LENS = 1024, 7, (96, 192)
PROMPT_LENGTHS, PROMPTS_PER_LENGTH, NUM_NEW = (9, 23, 41, 64, 90, 110, 129, 150), 8, 32
NUM_PROMPTS = len(PROMPT_LENGTHS) * PROMPTS_PER_LENGTH
# Two correct bf16 runs round at different points (ours: fused q | k | v and gate | up GEMMs,
# float32 rotary and norms): on an H100 our prefill distance to HF float32 was 0.88-1.27 times
# HF bf16's across these families, while the semantic slips it caught sat far above (Gemma 1
# soft-capped as Gemma 2: 4.7x; HF 5.17's SDPA dropping Gemma 2's soft-cap: 2.6x)
PREFILL_SLACK, ARGMAX_SLACK, GREEDY_SLACK = 1.5, 0.01, 0.08
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
MLA_E2E = dict(
    num_attention_heads=4,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
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
    ),
    "starcoder2": lambda: Starcoder2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=64, use_bias=True
    ),
    # latent attention (its cache one row a token; decodes through the MLA Triton kernel) with
    # grouped top-k MoE and shared experts: V2 without a q LoRA and softmax routing, V3 with
    # one, sigmoid routing, groups and yarn (mscale / mscale_all_dim)
    "deepseek_v2": lambda: DeepseekV2Config(**COMMON, **MLA_E2E, q_lora_rank=None),
    "deepseek_v3": lambda: DeepseekV3Config(
        **COMMON,
        **MLA_E2E,
        q_lora_rank=96,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
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
    # attention sinks (the Triton kernel's HAS_SINKS), 64-token windows on layers 0 and 2,
    # biased router and experts with the clamped SwiGLU (the fused-MoE kernel's switches)
    "gpt_oss": lambda: GptOssConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def periodic_tokens(rng: torch.Generator, n: int, length: int) -> torch.Tensor:
    """[n, length] sequences: a random block of PERIOD tokens (ids >= 3), repeated."""
    block = torch.randint(3, VOCAB, (n, PERIOD), generator=rng)
    return block.repeat(1, -(-length // PERIOD))[:, :length]


def train(arch: str, steps: int, device: str) -> torch.nn.Module:
    """An HF model trained to continue the period; fp32, on `device`."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", 0) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = periodic_tokens(rng, 64, TRAIN_LENS[step % len(TRAIN_LENS)]).to(device)
        labels = ids.clone()
        labels[:, :PERIOD] = -100  # the first block is unpredictable
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"\n{arch}: trained {steps} steps, final loss {loss.item():.4f}")
    return model.eval()


def prompts(seed: int = 1) -> list[list[int]]:
    """NUM_PROMPTS periodic prompts, PROMPTS_PER_LENGTH of each of PROMPT_LENGTHS (9..150
    tokens: crossing several 16-token KV blocks, the 64-token windows and Phi-3's original
    length 128), so that HF generates each length as one batch without padding."""
    gen = torch.Generator().manual_seed(seed)
    return [
        row.tolist() for n in PROMPT_LENGTHS for row in periodic_tokens(gen, PROMPTS_PER_LENGTH, n)
    ]


@pytest.fixture(scope="module", params=list(CONFIGS))
def trained(request, tmp_path_factory):
    """(arch, the saved bf16 folder, HF float32 on those weights, HF bf16), on the device."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = int(os.environ.get("PAGELLM_E2E_TRAIN_STEPS", "300"))
    folder = tmp_path_factory.mktemp(request.param)
    train(request.param, steps, DEVICE).to(torch.bfloat16).save_pretrained(folder)
    runs = [hf_model(folder, dtype).to(DEVICE) for dtype in (torch.float32, torch.bfloat16)]
    yield request.param, str(folder), *runs
    del runs
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _rows_by_length(batch: list[list[int]]) -> dict[int, list[int]]:
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(batch):
        by_length.setdefault(len(p), []).append(i)
    return by_length


def hf_greedy(model, batch: list[list[int]]) -> list[list[int]]:
    """HF's greedy continuations (`hf_generate_greedy`: as 5.25's `generate`, whatever the
    installed version), one batch per prompt length (no padding)."""
    out: list[list[int]] = [[] for _ in batch]
    for rows in _rows_by_length(batch).values():
        for i, row in zip(rows, hf_generate_greedy(model, [batch[i] for i in rows], NUM_NEW)):
            out[i] = row
    return out


def agreement(got: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of continuations identical to the reference, mean share of their tokens before
    the first divergence)."""
    matched = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
        for x, y in zip(got, reference)
    ]
    identical = sum(m == len(y) for m, y in zip(matched, reference)) / len(reference)
    return identical, sum(m / len(y) for m, y in zip(matched, reference)) / len(reference)


def logits_distance(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 distance, share of positions whose argmax differs)."""
    rel = ((logits - ref).norm() / ref.norm()).item()
    return rel, (logits.argmax(-1) != ref.argmax(-1)).float().mean().item()


def test_prefill_logits_no_further_from_fp32_than_hf_bf16(trained):
    from pagellm.attention.selector import get_attn_backend_cls

    arch, folder, hf32, hf16 = trained
    backend = get_attn_backend_cls(DEVICE)
    ours = load_our_model(folder, torch.bfloat16, device=DEVICE, attn_backend_cls=backend)
    batch = prompts(seed=2)[:: PROMPTS_PER_LENGTH // 2]  # 16 prompts, two of each length
    results = run_paged(ours, batch, num_decode_steps=0, chunk_size=40)
    peer, mine = [], []
    for prompt, (_, logits) in zip(batch, results):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            ref = hf32(input_ids=ids).logits[0].float().cpu()
            peer.append(logits_distance(hf16(input_ids=ids).logits[0].float().cpu(), ref))
        mine.append(logits_distance(logits, ref))
    (peer_rel, peer_flips), (our_rel, our_flips) = (
        [sum(v) / len(v) for v in zip(*runs)] for runs in (peer, mine)
    )
    print(f"\n{arch} prefill vs HF fp32: HF bf16 {peer_rel:.3e} rel, {peer_flips:.2%} argmax "
          f"flips; ours {our_rel:.3e}, {our_flips:.2%}")  # fmt: skip
    assert our_rel <= PREFILL_SLACK * peer_rel, f"{arch}: {our_rel:.3e} vs HF bf16 {peer_rel:.3e}"
    assert our_flips <= peer_flips + ARGMAX_SLACK, f"{arch}: {our_flips:.2%} vs {peer_flips:.2%}"


def test_greedy_no_further_from_fp32_than_hf_bf16(trained, monkeypatch):
    from pagellm import LLM, SamplingParams

    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    arch, folder, hf32, hf16 = trained
    batch = prompts()
    reference = hf_greedy(hf32, batch)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(
        model=folder,
        dtype="bfloat16",
        device=DEVICE,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=NUM_PROMPTS,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    got, peer_got = [list(o.outputs[0].token_ids) for o in outs], hf_greedy(hf16, batch)
    ours, peer = agreement(got, reference), agreement(peer_got, reference)
    by_length = {
        n: [sum(x[i] == reference[i] for i in rows) for x in (peer_got, got)]
        for n, rows in _rows_by_length(batch).items()
    }
    print(f"\n{arch} identical continuations by prompt length (HF bf16, ours): {by_length}")
    print(f"\n{arch} greedy vs HF fp32 ({len(batch)} x {NUM_NEW} tokens): HF bf16 "
          f"{peer[0]:.1%} identical, {peer[1]:.1%} of tokens before a divergence; ours "
          f"{ours[0]:.1%}, {ours[1]:.1%}")  # fmt: skip
    assert ours[0] >= peer[0] - GREEDY_SLACK, f"{arch}: identical {ours[0]:.1%} vs {peer[0]:.1%}"
    assert ours[1] >= peer[1] - GREEDY_SLACK, f"{arch}: matched {ours[1]:.1%} vs {peer[1]:.1%}"
