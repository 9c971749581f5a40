"""FP8 KV cache (`kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2"`).

- writes: the torch backend and Triton's reshape_and_cache store the same bytes, within fp8's
  rounding of the float values divided by the scale, saturating beyond fp8's range;
- reads: the torch backend equals float attention over the dequantized K/V; the paged Triton
  kernel (Triton's interpreter on CPU, compiled at realistic shapes on a GPU: `gpu` marker)
  equals the torch backend on the same fp8 cache, for decodes, prefill chunks after a
  context, GQA, sliding windows, soft-caps and split-KV;
- scales: checkpoint names, bad values, the first batch's scales (calculate_kv_scales);
- the engine on the embedded model's real weights: greedy agreement with a float32 cache
  >= 90% (teacher-forced: benchmarks/accuracy.py), and prefix-cache hits and preemption
  change no token.
"""

from __future__ import annotations

import os

import benchmark_modules
import pytest
import torch
from test_kernels import DEVICE, Batch  # first: sets TRITON_INTERPRET=1 on CPU
from test_sliding_window import WindowBatch, reference_attention
from test_torch_attention import _Case

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.attention.torch_backend import TorchAttentionBackend, write_kv
from pagellm.config import CacheConfig
from pagellm.kernels.paged_attention import paged_attention
from pagellm.kernels.reshape_and_cache import reshape_and_cache
from pagellm.kv_cache_dtype import K_SCALE_CONSTANT, V_SCALE_CONSTANT, quantize
from pagellm.layers.attention import Attention
from pagellm.layers.weights import load_packed_weights

accuracy = benchmark_modules.load("accuracy")  # the prompt set and the measures

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RELATIVE_STEP = {E4M3: 2.0**-3, E5M2: 2.0**-2}  # spacing of fp8 values, relative


def to_fp8(cache: torch.Tensor, fp8: torch.dtype, kv_scale: torch.Tensor) -> torch.Tensor:
    """A [2, ...] float cache quantized with [k_scale, v_scale] (NaN poison stays NaN)."""
    out = torch.empty(cache.shape, dtype=fp8, device=cache.device)
    for i in (0, 1):
        out.view(torch.uint8)[i] = quantize(cache[i], kv_scale[i].item(), fp8).view(torch.uint8)
    return out


def dequantize(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    return quantize(x, scale, fp8).float() * scale


# ---------------------------------------------------------------- writes


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_write_read_round_trip(fp8):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40, 3, 64, generator=g) * 4
    v = torch.randn(40, 3, 64, generator=g)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-9])  # saturate, zero, underflow
    scales = torch.tensor([0.05, 0.01])
    slots = torch.randperm(64, generator=g)[:40]
    torch_cache = torch.zeros(2, 64, 3, 64, dtype=torch.uint8).view(fp8)  # [2, slots, H_kv, D]
    write_kv(torch_cache[0], torch_cache[1], k, v, slots, scales)
    for x, cache, scale in ((k, torch_cache[0], 0.05), (v, torch_cache[1], 0.01)):
        got = cache[slots].float() * scale
        fp8_max = torch.finfo(fp8).max * scale
        want = x.clamp(-fp8_max, fp8_max)
        assert not got.isnan().any()
        # within half a step of fp8's grid (relative), or of its smallest step near zero
        tol = want.abs() * RELATIVE_STEP[fp8] / 2 + torch.finfo(fp8).smallest_normal * scale
        assert (got - want).abs().le(tol).all()
    fp8_max = torch.finfo(fp8).max
    assert torch_cache[0, slots[0], 0, :2].float().tolist() == [fp8_max, -fp8_max]
    # the Triton write (4-D paged view of the same slots) stores the same bytes
    triton_cache = torch.zeros(2, 4, 16, 3, 64, dtype=torch.uint8).view(fp8).to(DEVICE)
    reshape_and_cache(k.to(DEVICE), v.to(DEVICE), triton_cache, slots.to(DEVICE), scales.to(DEVICE))
    written = triton_cache.view(2, 64, 3, 64).cpu()
    assert torch.equal(written.view(torch.uint8), torch_cache.view(torch.uint8))


# ---------------------------------------------------------------- reads


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_torch_backend_reads_dequantized_values(fp8):
    case = _Case([(6, 0), (1, 12), (4, 9), (1, 3), (13, 0), (1, 40)], 8, 2, 16, 4, seed=1)
    scales = torch.tensor([0.05, 0.02])
    cache = to_fp8(case.cache, fp8, scales)
    backend = TorchAttentionBackend(8, 2, 16, 0.25)
    q, k, v, common = case.inputs()
    out = backend.forward(q, k, v, cache, TorchAttentionBackend.build_metadata(common), scales)
    expected = torch.cat([
        reference_attention(qq, dequantize(kv[0], 0.05, fp8), dequantize(kv[1], 0.02, fp8), c, 0.25)
        for qq, kv, (_, c) in zip(case.q, case.kv, case.reqs)
    ])  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # fp8 changes the result, within what its rounding allows
    err = (out - case.expected(0.25)).abs().max().item()
    assert 1e-3 < err < {E4M3: 0.2, E5M2: 0.4}[fp8]


def kernel_vs_torch(batch: Batch, fp8, scales, window=None, soft_cap=None, num_splits=None):
    """The Triton path (reshape_and_cache, paged_attention) and the torch backend on copies
    of one fp8 cache: outputs and written caches."""
    batch.kv_cache = to_fp8(batch.kv_cache, fp8, scales.to(DEVICE))
    torch_cache = batch.kv_cache.clone()
    scales = scales.to(DEVICE)
    n = batch.num_actual_tokens
    reshape_and_cache(batch.k[:n], batch.v[:n], batch.kv_cache, batch.slot_mapping, scales)
    out = torch.full_like(batch.q[:n], float("nan"))
    plan = batch.plan(kv_element_size=1, num_splits=num_splits)
    paged_attention(
        batch.q[:n], batch.kv_cache, batch.block_table, batch.seq_lens_t, batch.query_start_loc,
        batch.scale, plan=plan, out=out, logits_soft_cap=soft_cap, kv_scale=scales,
    )  # fmt: skip
    backend = TorchAttentionBackend(
        batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.scale,
        sliding_window=window, logits_soft_cap=soft_cap,
    )  # fmt: skip
    metadata = TorchAttentionBackend.build_metadata(batch.common())
    want = backend.forward(batch.q[:n], batch.k[:n], batch.v[:n], torch_cache, metadata, scales)
    assert not out.isnan().any(), "rows never written, or NaN-poisoned slots read"
    assert torch.equal(batch.kv_cache.view(torch.uint8), torch_cache.view(torch.uint8))
    return out.float().cpu(), want.float().cpu()


@pytest.mark.parametrize(
    "fp8,dtype,query_lens,context_lens,heads",
    [
        (E4M3, torch.float32, [1, 24, 1, 13], [170, 0, 3, 30], (8, 2)),  # mixed, GQA
        (E5M2, torch.float16, [1, 1, 1], [37, 5, 200], (4, 4)),  # decodes
    ],
)
def test_kernel_matches_torch_backend(fp8, dtype, query_lens, context_lens, heads):
    batch = Batch(query_lens, context_lens, *heads, 32, 16, dtype, seed=3)
    out, want = kernel_vs_torch(batch, fp8, torch.tensor([0.03, 0.02]))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_kernel_window_soft_cap_split_kv_match_torch_backend():
    batch = WindowBatch([1, 1, 9], [700, 300, 60], 8, 2, 32, 16, torch.float32,
                        window=150, soft_cap=3.0, seed=4)  # fmt: skip
    out, want = kernel_vs_torch(batch, E4M3, torch.tensor([0.04, 0.01]), 150, 3.0, num_splits=3)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1] * 64, [2047] * 64),  # decode batch
        ([1] * 2, [16383, 9000]),  # long-context decode: split-KV
        ([512, 1, 1, 300] + [1] * 28, [1536, 4000, 100, 0] + [700] * 28),  # mixed
    ],
)
def test_kernel_matches_torch_backend_gpu(fp8, query_lens, context_lens):
    """Realistic shapes in bf16 (Qwen3-8B's heads): the compiled kernels on an fp8 cache."""
    batch = Batch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, seed=7)
    out, want = kernel_vs_torch(batch, fp8, torch.tensor([0.05, 0.02]))
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- scales and arguments


def test_checkpoint_scales_load_by_vllm_names():
    names = {"a": ("k_scale", "v_scale"), "b": ("kv_scale",), "c": ("k_proj.k_scale",)}
    model = torch.nn.Module()
    for layer in names:  # `<layer>.self_attn.attn`, as in the decoders
        holder, self_attn = torch.nn.Module(), torch.nn.Module()
        self_attn.attn = Attention(4, 2, 16, TorchAttentionBackend)
        holder.self_attn = self_attn
        setattr(model, layer, holder)
    weights = [
        (f"{layer}.self_attn.{n}", torch.tensor(0.5 + i)) for layer, ns in names.items()
        for i, n in enumerate(ns)
    ]  # fmt: skip
    assert load_packed_weights(model, weights, {}) == set()  # buffers, not parameters
    scales = {layer: getattr(model, layer).self_attn.attn.kv_scale.tolist() for layer in names}
    assert scales == {"a": [0.5, 1.5], "b": [0.5, 0.5], "c": [0.5, 1.0]}
    with pytest.raises(ValueError, match="positive"):
        load_packed_weights(model, [("a.self_attn.v_scale", torch.tensor(0.0))], {})


def test_first_batch_scales():
    attn = Attention(4, 2, 16, TorchAttentionBackend)
    case = _Case([(5, 0), (3, 0)], 4, 2, 16, 4, seed=2)
    q, k, v, common = case.inputs()
    cache = torch.zeros(case.cache.shape, dtype=torch.uint8).view(E4M3)
    attn.calculate_kv_scales = True
    attn(q, k * 7, v, cache, TorchAttentionBackend.build_metadata(common))
    want = [(k * 7).abs().max() / K_SCALE_CONSTANT, v.abs().max() / V_SCALE_CONSTANT]
    torch.testing.assert_close(attn.kv_scale, torch.stack(want))
    assert not attn.calculate_kv_scales  # once


def test_bad_kv_cache_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # before the model is looked up
        EngineArgs(model="/no/such/model", kv_cache_dtype="fp16").create_engine_config()


def test_cli_flags():
    import argparse

    from pagellm.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales"])
    args = engine_args_from(ns)
    assert (args.kv_cache_dtype, args.calculate_kv_scales) == ("fp8_e5m2", True)


# ---------------------------------------------------------------- the engine, real weights

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# every calculate_kv_scales engine below computes its scales from this first step (a
# one-word first batch gives scales that later keys outgrow: 0.89 agreement, not 0.95)
FIRST_BATCH = accuracy.PROMPTS[:16]


@pytest.fixture(scope="module")
def in_process():
    old = os.environ.get("PAGELLM_ENABLE_MULTIPROCESSING")
    os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"  # to read the runner's scales
    yield
    if old is None:
        del os.environ["PAGELLM_ENABLE_MULTIPROCESSING"]
    else:
        os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = old


def fp8_engine(calculate_kv_scales: bool = False, **kwargs) -> LLM:
    # dequantized weights: the default's block kernel (decodes) and dense copy (prefill)
    # differ by summation order, which an fp8 rounding of K/V can turn into another token
    # after a preemption's recompute
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_dtype="fp8",
              kv_cache_memory_bytes=64 << 20, calculate_kv_scales=calculate_kv_scales,
              quantization="none", **kwargs)  # fmt: skip
    if calculate_kv_scales:
        llm.generate(FIRST_BATCH, SamplingParams(max_tokens=1), use_tqdm=False)
    return llm


@pytest.fixture(scope="module")
def fp8_llm(in_process):
    """Scales 1.0 (the default)."""
    with fp8_engine() as llm:
        yield llm


@pytest.fixture(scope="module")
def fp8_scaled_llm(in_process):
    """Scales from the first batch."""
    with fp8_engine(calculate_kv_scales=True) as llm:
        yield llm


def test_scales_come_from_the_first_batch(fp8_scaled_llm):
    runner = fp8_scaled_llm.llm_engine.engine_core.engine_core.model_executor.model_runner
    for layer in runner.model.model.layers:
        k_scale, v_scale = layer.self_attn.attn.kv_scale.tolist()
        assert k_scale != 1.0 and v_scale != 1.0
    # the first batch's largest key is stored as K_SCALE_CONSTANT (200, rounded to e4m3's 192
    # or 208); later keys may be larger, up to e4m3's 448
    stored = runner.kv_caches[0][0].float().abs().amax().item()
    assert 192 <= stored <= 448


@pytest.fixture(scope="module")
def float32_continuations(llm):
    """16 prompts and their 32 greedy tokens with a float32 cache."""
    prompts = accuracy.prompt_ids(llm, accuracy.PROMPTS[:16])
    return prompts, accuracy.greedy(llm, [{"prompt_token_ids": p} for p in prompts], 32)


@pytest.mark.parametrize("scaled", [False, True], ids=["scales 1.0", "first-batch scales"])
def test_greedy_agreement_with_a_float32_cache(request, float32_continuations, scaled):
    """Teacher-forced greedy agreement >= 90% along the float32 cache's greedy continuations
    (0.955 with scales 1.0, 0.951 from the first batch; 0.957 over 64 prompts:
    benchmarks/accuracy.py)."""
    llm = request.getfixturevalue("fp8_scaled_llm" if scaled else "fp8_llm")
    prompts, conts = float32_continuations
    rate = accuracy.agreement(conts, accuracy.teacher_forced_top1(llm, prompts, conts))
    print(f"\nfp8 KV top-1 agreement with a float32 cache: {rate:.3f}")
    assert 0.9 <= rate < 1.0  # < 1: the cache really is fp8


SHARED_PREFIX = "You are a careful assistant. Answer briefly and precisely, in plain English. "
PREFIXED = [SHARED_PREFIX + p for p in accuracy.PROMPTS[:4]]


@pytest.fixture(scope="module")
def fp8_reference(fp8_llm):
    fp8_llm.reset_prefix_cache()
    outs = fp8_llm.generate(PREFIXED, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_cache_hits_do_not_change_outputs(fp8_llm, fp8_reference):
    again = fp8_llm.generate(PREFIXED, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert [o.outputs[0].token_ids for o in again] == fp8_reference


def test_preemption_does_not_change_outputs(in_process, fp8_reference):
    # 4 requests of ~40 tokens need 12 blocks of 16; 6 force preemption by recompute
    with fp8_engine(num_gpu_blocks_override=6) as llm:
        outs = llm.generate(PREFIXED, PARAMS, use_tqdm=False)
        assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == fp8_reference
