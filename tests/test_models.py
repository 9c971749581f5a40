"""Our Llama / Qwen2 / Qwen3 logits equal HF transformers' (float32, CPU) through the paged
KV cache: flat prefill batches, chunked prefill over a cached context, prefix-cache hits,
and mixed batches of decodes and prefills in random order over non-contiguous blocks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from model_utils import (
    PagedRunner,
    hf_logits,
    load_our_model,
    make_tiny_hf_model,
    run_paged,
    write_tiny_gguf,
)
from transformers import AutoModelForCausalLM

from pagellm.kernels import cpu_gemm, panel_gemm
from pagellm.kernels.cpu_gemm import CpuGemmPlan, PackedWeight, cpu_prepack_supported
from pagellm.models import get_model_cls
from pagellm.models.llama import LlamaForCausalLM

ATOL, RTOL = 2e-4, 1e-5  # fp32; the CPU decode kernel sums in another order than HF
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-llama3rope-tied": ("llama", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(HF model, our model) from one tiny random checkpoint."""
    arch, overrides = VARIANTS[request.param]
    folder = make_tiny_hf_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, load_our_model(folder)


def _prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in lengths]


def _assert_matches_hf(hf, results) -> None:
    for tokens, logits in results:
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_prefill_flat_batch(pair):
    hf, ours = pair
    _assert_matches_hf(hf, run_paged(ours, _prompts(5, 17, 33, 3, 16), num_decode_steps=0))


def test_chunked_prefill_over_cached_context(pair):
    hf, ours = pair
    results = run_paged(ours, _prompts(23, 9, 40), num_decode_steps=2, chunk_size=5, block_size=4)
    _assert_matches_hf(hf, results)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_decodes_and_prefills(pair, block_size):
    hf, ours = pair
    prompts = _prompts(12, 30, 7, 19, 2, seed=block_size)
    results = run_paged(
        ours,
        prompts,
        num_decode_steps=5,
        block_size=block_size,
        chunk_size=7,
        stagger=True,
        shuffle=True,
        seed=block_size,
    )
    _assert_matches_hf(hf, results)


def test_prefix_cache_hit(pair):
    hf, ours = pair
    first, tail = _prompts(37, 6)
    second = first[:32] + tail
    runner = PagedRunner(ours, block_size=8)
    runner.add(0, first)
    runner.step([(0, len(first))])
    runner.add(1, second, share_blocks_of=0)
    assert runner.seqs[1].num_computed == 32  # four full blocks come from the cache
    logits = runner.step([(1, len(second) - 32)])[1]
    torch.testing.assert_close(logits, hf_logits(hf, second)[32:], atol=ATOL, rtol=RTOL)


def test_padded_inputs(pair):
    """Rows beyond num_actual_tokens (graph padding) do not change the real rows."""
    _, ours = pair
    prompts = _prompts(6, 1, 9)
    runner = PagedRunner(ours, block_size=4)
    for i, p in enumerate(prompts):
        runner.add(i, p)
    schedule = [(i, len(p)) for i, p in enumerate(prompts)]
    for seq_id, n in schedule:
        runner._allocate(runner.seqs[seq_id], n)
    common, ids, positions = runner._build_inputs(schedule)
    metadata = ours.attn_backend_cls.build_metadata(common)
    pad = torch.zeros(4, dtype=torch.int64)
    with torch.inference_mode():
        plain = ours(ids, positions, runner.kv_caches, metadata)
        padded = ours(
            torch.cat([ids, pad]), torch.cat([positions, pad]), runner.kv_caches, metadata
        )
    torch.testing.assert_close(padded[: len(ids)], plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_equals_safetensors(arch, tmp_path):
    """An F32 GGUF of a checkpoint (Q/K permuted for llama) loads to the same parameters."""
    folder = make_tiny_hf_model(arch, tmp_path)
    path = write_tiny_gguf(folder, str(tmp_path / "tiny.gguf"), "F32", arch)
    from_st, from_gguf = load_our_model(folder), load_our_model(path)
    gguf_params = dict(from_gguf.named_parameters())
    for name, param in from_st.named_parameters():
        assert torch.equal(gguf_params[name], param), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_gguf_matches_hf(qtype, tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path)
    write_tiny_gguf(folder, str(tmp_path / "tiny.gguf"), qtype, "llama")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ours = load_our_model(str(tmp_path / "tiny.gguf"))
    _assert_matches_hf(hf.eval(), run_paged(ours, _prompts(11, 4), num_decode_steps=3))


@pytest.mark.parametrize("variant", ["qwen2", "llama-llama3rope-tied"])
def test_prepacked_cpu_weights_match_hf(variant, tmp_path, monkeypatch):
    """Linear weights (and a tied LM head) packed for oneDNN, as the CPU runner does."""
    if not cpu_prepack_supported(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN weight packing needs an x86 CPU")
    arch, overrides = VARIANTS[variant]
    folder = make_tiny_hf_model(arch, tmp_path, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_our_model(folder)
    ours.prepack_cpu_weights(batch_hint=8)
    assert ours.model.layers[0].mlp.gate_up_proj.weight is None  # only the packed copy is kept
    assert (ours.packed_tied_head is not None) == ours.tie_word_embeddings
    _assert_matches_hf(hf, run_paged(ours, _prompts(9, 1, 20), num_decode_steps=3, shuffle=True))
    monkeypatch.setenv("PAGELLM_CPU_PREPACK", "0")
    assert not cpu_prepack_supported(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("library", ["mkl", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_any_batch_size(dtype, library):
    """One packed copy (MKL or oneDNN for float32, oneDNN for bfloat16) serves every row count."""
    if not cpu_prepack_supported(torch.device("cpu"), dtype):
        pytest.skip("weight packing needs an x86 CPU")
    if library == "mkl" and not cpu_gemm.mkl_packing_is_batch_independent():
        pytest.skip("MKL's packed sgemm is not usable here")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=gen).to(dtype)
    bias = torch.randn(300, generator=gen).to(dtype)
    packed = PackedWeight(weight, batch_hint=64, plan=CpuGemmPlan(library))
    if dtype == torch.float32:
        assert packed.onednn is None and packed.fp32.library == library
    elif cpu_gemm.onednn_bf16_supported():
        assert packed.onednn is not None and packed.fp32 is None
    else:  # no bf16 GEMM in oneDNN (AVX2): the weight in float32 for every row count
        assert packed.onednn is None and packed.fp32.library == library
        assert packed.fp32_from_rows == 0
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for rows in (1, 2, 63, 64, 65, 700):
        x = torch.randn(rows, 72, generator=gen).to(dtype)
        torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), **tol)
        torch.testing.assert_close(packed(x), F.linear(x, weight), **tol)


def test_bf16_without_onednn_bf16_runs_in_float32(monkeypatch):
    """On a CPU where oneDNN has no bf16 GEMM (AVX2 only: its weight reorder raises), the
    plan times no bf16 path and every bf16 weight runs in float32 arithmetic."""
    if not cpu_prepack_supported(torch.device("cpu"), torch.float32):
        pytest.skip("weight packing needs an x86 CPU")
    monkeypatch.setattr(cpu_gemm, "onednn_bf16_supported", lambda: False)
    monkeypatch.setattr(cpu_gemm.torch.ops.mkldnn, "_reorder_linear_weight", _refuse_bf16)
    monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "0")
    plan = cpu_gemm.cpu_gemm_plan.__wrapped__()
    assert "no bf16 GEMM on this CPU" in plan.describe(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    packed = PackedWeight(weight, batch_hint=8, plan=plan)
    assert packed.onednn is None and packed.fp32_from_rows == 0
    for rows in (1, 9):
        x = torch.randn(rows, 48, generator=gen).to(torch.bfloat16)
        want = F.linear(x.float(), weight.float()).to(torch.bfloat16)
        torch.testing.assert_close(packed(x), want, rtol=0, atol=1e-2)


_REORDER = torch.ops.mkldnn._reorder_linear_weight


def _refuse_bf16(weight: torch.Tensor, *args):
    if weight.dtype == torch.bfloat16:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")
    return _REORDER(weight, *args)


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_bf16_weight_in_fp32_arithmetic(library):
    """A bf16 weight whose plan says float32 arithmetic from some row count: oneDNN's bf16
    GEMM below it, from there the weight widened to float32 (exact products, float32 sums,
    one rounding to bf16 at the end); bf16 in, bf16 out either way."""
    if not cpu_prepack_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("weight packing needs an x86 CPU")
    if library == "mkl" and not cpu_gemm.mkl_packing_is_batch_independent():
        pytest.skip("MKL's packed sgemm is not usable here")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=gen).to(torch.bfloat16)
    bias = torch.randn(300, generator=gen).to(torch.bfloat16)
    first = 8
    if not cpu_gemm.onednn_bf16_supported():  # then float32 arithmetic from the first row
        first = 0
    packed = PackedWeight(weight, batch_hint=64, plan=CpuGemmPlan(library, first or 8))
    assert (packed.onednn is not None) == (first > 0) and packed.fp32.library == library
    for rows in (1, max(first - 1, 2), first or 3, 65):
        x = torch.randn(rows, 200, generator=gen).to(torch.bfloat16)
        exact = F.linear(x.double(), weight.double(), bias.double())
        got = packed(x, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        if rows >= first:  # float32 sums: the bf16 rounding of the exact result, nearly always
            torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=0, atol=0.07)
            assert (got != exact.to(torch.bfloat16)).float().mean() < 0.02
        else:
            torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=0.15)


@pytest.mark.skipif(not panel_gemm.supported(torch.float32), reason="needs AVX-512 or AVX2 + FMA")
def test_float32_panels_against_float64():
    """Our float32 GEMM: float32 FMAs along K, any row count (every pass size of the AVX-512
    tiles of 8 and the AVX2 tiles of 12: passes of 1-3 rows over a panel, 1-6 over a half),
    sizes off the panels, a bias, a strided x; within float32 rounding of the float64
    result; a plan naming it keeps one copy of the weight in its panels."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((300, 72), (33, 131), (64, 1)):
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        panels = panel_gemm.Panels(weight)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 65, 150):
            x = torch.randn(rows, k + 4, generator=gen)[:, 2 : 2 + k]
            exact = F.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(panels(x, bias).double(), exact, rtol=1e-5, atol=1e-4)
    packed = PackedWeight(weight, 16, CpuGemmPlan("pagellm"))
    assert packed.panels is not None and packed.onednn is None and packed.fp32 is None
    assert "pagellm" in CpuGemmPlan("pagellm").describe(torch.float32)


@pytest.mark.skipif(not panel_gemm.supported(), reason="our bf16 kernel needs AVX512-BF16")
def test_bf16_kernel_against_exact_products():
    """Our bf16 GEMM: exact products summed in float32, one rounding to bf16, for any row
    count (tiles of 8 rows, passes of 64), output sizes off the 32-row panels, a bias, a
    strided x and a 3-D x; it is the nearest bf16 of the exact result nearly always."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((300, 72), (33, 130), (64, 2)):
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        panels = panel_gemm.Panels(weight)
        for rows in (1, 2, 7, 8, 9, 64, 65, 150):
            wide = torch.randn(rows, k + 6, generator=gen).to(torch.bfloat16)
            x = wide[:, 3 : 3 + k]  # rows k + 6 apart
            for b in (None, bias):
                exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
                got = panels(x, b)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)
                assert (got != exact.to(torch.bfloat16)).float().mean() < 0.02
        x3 = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(panels(x3), panels(x3.reshape(6, k)).view(2, 3, n))
    with pytest.raises(ValueError, match="even K"):
        panel_gemm.Panels(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 weight"):
        panel_gemm.Panels(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="Panels"):
        panels(torch.zeros(1, 3, dtype=torch.bfloat16))


@pytest.mark.skipif(not panel_gemm.supported(), reason="our bf16 kernel needs AVX512-BF16")
def test_packed_weight_bf16_kernel():
    """A plan with our bf16 kernel keeps one copy of the weight, the kernel's panels (an odd
    input size keeps oneDNN's), and answers as F.linear does."""
    gen = torch.Generator().manual_seed(0)
    plan = CpuGemmPlan("onednn", bf16_kernel=True)
    weight = torch.randn(96, 40, generator=gen).to(torch.bfloat16)
    packed = PackedWeight(weight, 16, plan)
    assert packed.panels is not None and packed.onednn is None and packed.fp32 is None
    x = torch.randn(5, 40, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(packed(x).float(), F.linear(x.float(), weight.float()),
                               rtol=2e-2, atol=5e-2)  # fmt: skip
    odd = PackedWeight(torch.randn(8, 7).to(torch.bfloat16), 16, plan)
    assert odd.panels is None and odd.onednn is not None
    assert "AVX512-BF16 kernel" in plan.describe(torch.bfloat16)


# timings (us) of three machines of our pool, 2 cores each (docs/notes.md, CPU GEMMs)
_AMX = {("mkl", 1): 40, ("onednn", 1): 45, ("mkl", 8): 60, ("onednn", 8): 66, ("mkl", 32): 300,
        ("onednn", 32): 310, ("bf16", 8): 30, ("bf16_in_fp32", 8): 60, ("bf16", 32): 90,
        ("bf16_in_fp32", 32): 300}  # fmt: skip
_INTEL_NO_AMX = {**_AMX, ("bf16", 8): 294, ("bf16_in_fp32", 8): 242, ("bf16", 32): 1356,
                 ("bf16_in_fp32", 32): 819}  # fmt: skip
_AMD = {("mkl", 1): 417, ("onednn", 1): 154, ("mkl", 8): 1087, ("onednn", 8): 209,
        ("mkl", 32): 2202, ("onednn", 32): 756, ("bf16", 8): 168, ("bf16_in_fp32", 8): 220,
        ("bf16", 32): 352, ("bf16_in_fp32", 32): 754}  # fmt: skip


@pytest.mark.parametrize(
    "times, library, from_rows",
    [(_AMX, "mkl", None), (_INTEL_NO_AMX, "mkl", 8), (_AMD, "onednn", None),
     ({**_INTEL_NO_AMX, ("bf16", 8): 250}, "mkl", 32),  # a tie at 8 rows: from 32
     ({**_AMD, ("mkl", 32): 800, ("mkl", 8): 215, ("mkl", 1): 160}, "mkl", None)],  # a tie
)  # fmt: skip
def test_cpu_gemm_plan_from_timings(times, library, from_rows):
    """The library that is clearly faster on the machine's timings; ties keep the default."""
    plan = cpu_gemm.choose_plan(times, "mkl", bf16_fp32=None)
    assert (plan.fp32_library, plan.bf16_fp32_from_rows) == (library, from_rows)
    assert not plan.bf16_kernel and "timed" in plan.describe(torch.bfloat16)


@pytest.mark.parametrize("times", [_AMX, _INTEL_NO_AMX, _AMD])
def test_cpu_gemm_plan_bf16_kernel(times):
    """Our bf16 kernel, timed beside oneDNN's paths: taken unless clearly slower than the
    best of them (the AMD EPYC's own timings: 0.62x / 0.98x), and then it replaces both;
    the float32 choice is made as before; forced or forbidden by its env knob."""
    best = {r: min(times["bf16", r], times["bf16_in_fp32", r]) for r in cpu_gemm.BF16_ROWS}
    library = cpu_gemm.choose_plan(times, "mkl", bf16_fp32=None).fp32_library
    for factor, taken in ((0.6, True), (1.1, True), (1.3, False)):
        timed = {**times, **{("bf16_kernel", r): factor * b for r, b in best.items()}}
        plan = cpu_gemm.choose_plan(timed, "mkl", bf16_fp32=None, bf16_kernel=None)
        assert plan.bf16_kernel == taken and plan.fp32_library == library
        if taken:
            assert plan.bf16_fp32_from_rows is None and "our kernel" in plan.note
    assert cpu_gemm.choose_plan({}, "mkl", bf16_fp32=None, bf16_kernel=True).bf16_kernel


def test_cpu_gemm_plan_float32_kernel():
    """Our float32 kernel, timed beside MKL and oneDNN: taken unless clearly slower than the
    faster of the two."""
    for factor, library in ((0.5, "pagellm"), (1.1, "pagellm"), (1.3, "onednn")):
        timed = {**_AMD, **{("pagellm", r): factor * _AMD["onednn", r] for r in (1, 8, 32)}}
        plan = cpu_gemm.choose_plan(timed, "mkl", bf16_fp32=None)
        assert plan.fp32_library == library and "our kernel" in plan.note


def test_cpu_gemm_plan_bf16_kernel_env(monkeypatch):
    """PAGELLM_CPU_BF16_KERNEL=0 forbids our kernel, =1 takes it untimed where the CPU has
    it; float32 arithmetic forced for bf16 rules it out."""
    plan = cpu_gemm.cpu_gemm_plan.__wrapped__
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "onednn")
    monkeypatch.setenv("PAGELLM_CPU_BF16_FP32_GEMM", "0")
    monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "0")
    assert plan() == CpuGemmPlan("onednn", note="set by PAGELLM_CPU_*")
    monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "1")
    assert plan().bf16_kernel == panel_gemm.supported()
    monkeypatch.setenv("PAGELLM_CPU_BF16_FP32_GEMM", "1")
    assert not plan().bf16_kernel


def test_cpu_gemm_plan_env(monkeypatch):
    """The env knobs override the timing; the plan measured here names usable libraries."""
    plan = cpu_gemm.cpu_gemm_plan.__wrapped__
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "onednn")
    monkeypatch.setenv("PAGELLM_CPU_BF16_FP32_GEMM", "1")
    assert plan() == CpuGemmPlan("onednn", cpu_gemm.FP32_FROM_ROWS, note="set by PAGELLM_CPU_*")
    monkeypatch.setenv("PAGELLM_CPU_BF16_FP32_GEMM", "0")
    assert plan().bf16_fp32_from_rows is None
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "openblas")
    with pytest.raises(ValueError, match="PAGELLM_CPU_FP32_GEMM"):
        plan()
    if not cpu_prepack_supported(torch.device("cpu"), torch.bfloat16):
        return
    monkeypatch.delenv("PAGELLM_CPU_FP32_GEMM")
    monkeypatch.delenv("PAGELLM_CPU_BF16_FP32_GEMM")
    measured = plan()
    assert measured.fp32_library in cpu_gemm.FP32_LIBRARIES
    assert measured.bf16_fp32_from_rows in (None, *cpu_gemm.BF16_ROWS)
    weight = torch.randn(64, 32).bfloat16()
    x = torch.randn(40, 32).bfloat16()
    got = PackedWeight(weight, 16, measured)(x)
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float()), rtol=2e-2,
                               atol=5e-2)  # fmt: skip


def test_registry():
    assert get_model_cls("LlamaForCausalLM") is LlamaForCausalLM
    assert issubclass(get_model_cls("MistralForCausalLM"), LlamaForCausalLM)
    assert get_model_cls("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_cls("GPT2LMHeadModel")


@pytest.fixture(scope="module")
def our_smollm(embedded_gguf):
    return load_our_model(os.path.join(*embedded_gguf))


@pytest.mark.slow
def test_embedded_gguf_weights_equal_hf(our_smollm, hf_smollm):
    hf = hf_smollm.state_dict()
    for name, param in our_smollm.named_parameters():
        if ".qkv_proj." in name:
            parts = [hf[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(param, torch.cat(parts)), name
        elif ".gate_up_proj." in name:
            parts = [hf[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
            assert torch.equal(param, torch.cat(parts)), name
        else:
            assert torch.equal(param, hf[name]), name


@pytest.mark.slow
def test_embedded_gguf_logits_equal_hf(our_smollm, hf_smollm):
    from pagellm.loader import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(None))
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    _assert_matches_hf(hf_smollm, run_paged(our_smollm, prompts, num_decode_steps=4))


def test_cpu_gemm_plan_whole_from_env(monkeypatch):
    """PAGELLM_CPU_GEMM_PLAN (a plan's `setting()`, as a core reports it) is taken whole and
    untimed, over the other knobs: how a server's later cores compute as its first."""
    plan = cpu_gemm.cpu_gemm_plan.__wrapped__
    chosen = CpuGemmPlan("onednn", cpu_gemm.BF16_ROWS[-1], note="timed at start-up")
    monkeypatch.setenv("PAGELLM_CPU_GEMM_PLAN", chosen.setting())
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "mkl")
    assert plan() == CpuGemmPlan(
        "onednn", cpu_gemm.BF16_ROWS[-1], note="set by PAGELLM_CPU_GEMM_PLAN"
    )
    bad = ['{"fp32_library": "mkl"}', "mkl", chosen.setting().replace("onednn", "blas")]
    for value in bad:
        monkeypatch.setenv("PAGELLM_CPU_GEMM_PLAN", value)
        with pytest.raises(ValueError):
            plan()
