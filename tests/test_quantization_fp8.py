"""fp8 weights: block-scale dequantization, the Triton fp8 GEMMs and activation quantization
(under Triton's interpreter on the CPU) against torch references, fp8 checkpoints (block,
per-tensor, compressed-tensors per-channel) loaded on the CPU (dequantized) against HF with
the same dequantized weights, and bad configurations. `gpu` tests: the kernels at Llama-3.1-8B
shapes against `torch._scaled_mm`, fp8 engines at real and tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from model_utils import hf_logits, load_our_model, make_tiny_hf_model, run_paged
from safetensors.torch import load_file, save_file

from pagellm.quantization import resolve_quantization
from pagellm.quantization.fp8 import FP8, dequantize_fp8, quantize_weight_per_row

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if HAS_TRITON and DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the GEMM's K loop has a runtime bound
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 128x128-block quantization, one block at a time: (fp8, scales)."""
    n, k = w.shape
    scales = torch.empty(-(-n // 128), -(-k // 128))
    q = torch.empty(n, k, dtype=FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            scales[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scales[i, j]).to(FP8)
    return q, scales


def test_block_dequantization_matches_reference():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scales = _block_quantize(w)
    deq = dequantize_fp8(q, scales)
    for i, j in ((0, 0), (1, 2), (199, 299), (130, 5)):
        assert deq[i, j] == q[i, j].float() * scales[i // 128, j // 128]
    assert (deq - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits
    q_row, s_row = quantize_weight_per_row(w)
    torch.testing.assert_close(dequantize_fp8(q_row, s_row), q_row.float() * s_row[:, None])


# ---------------------------------------------------------------- kernels


@needs_triton
@pytest.mark.parametrize("group", [None, 128])
def test_quantize_fp8_activations(group):
    """Values on the e4m3 grid times a power of two per group (each reaching 448): the scales
    are the factors and q the grid values, exactly. (Triton 3.6's interpreter rounds float32
    to fp8 wrongly when the mantissa carries, so off-grid values are checked on CUDA only.)"""
    from pagellm.kernels.fp8_gemm import quantize_fp8

    gen = torch.Generator().manual_seed(1)
    grid = torch.randint(0, 256, (3, 256), generator=gen, dtype=torch.uint8).view(FP8).float()
    grid = grid.nan_to_num(0.0)
    width = group or 256
    grid.view(3, -1, width)[..., 0] = 448.0
    factor = 2.0 ** torch.randint(-8, 3, (3, 256 // width), generator=gen).float()  # exact
    x = (grid.view(3, -1, width) * factor[..., None]).view(3, 256).to(DEVICE)
    q, scale = quantize_fp8(x, group)
    torch.testing.assert_close(scale.cpu(), factor)
    torch.testing.assert_close(q.float().cpu(), grid, rtol=1e-6, atol=0)
    if DEVICE == "cuda":
        x = torch.randn(3, 256, device=DEVICE) * 3
        q, scale = quantize_fp8(x, group)
        deq = (q.float().view(3, -1, width) * scale[..., None]).view_as(x)
        assert ((deq - x).abs() <= x.abs() / 16 + scale.max() * 2**-9).all()


@needs_triton
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("unrolled", [False, True])
def test_fp8_gemv_over_several_k_steps(block, unrolled):
    """One row of x (the GEMV kernel), K of several BLOCK_K steps, in a runtime loop and
    unrolled (the default config's K_STEPS), 3 rows (a program's second row masked off)."""
    from pagellm.kernels.fp8_gemm import fp8_gemm, gemv_config

    gen = torch.Generator().manual_seed(3)
    n, k = 3, 3072
    cfg = gemv_config(n, k, 128 if block else 0)
    assert k // cfg["BLOCK_K"] >= 3 and cfg["K_STEPS"] in (0, k // cfg["BLOCK_K"])
    cfg["K_STEPS"] = k // cfg["BLOCK_K"] if unrolled else 0
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = _block_quantize(w) if block else quantize_weight_per_row(w)
    x = torch.randn(1, k, generator=gen)
    args = (x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE))
    got = fp8_gemm(*args, out_dtype=torch.float32, config=cfg)
    want = F.linear(x, dequantize_fp8(q, scale))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_triton
@pytest.mark.parametrize("block", [False, True])
def test_fp8_gemv_gated_is_silu_and_mul_of_the_gemv(block):
    """gate | up with SiLU-and-mul in the GEMV's epilogue (batch-1 MLPs): the same bf16 values
    as the GEMV followed by the SiLU-and-mul kernel, the unfused path (the interpreter rounds
    to bf16 unlike torch, so that kernel is the reference), bias included; 7 outputs with
    per-row scales (one gate and one up row a program), 256 with block scales; and close to
    torch's F.silu(gate) * up."""
    from pagellm.kernels import fused
    from pagellm.kernels.fp8_gemm import fp8_gemm

    gen = torch.Generator().manual_seed(5)
    half, k = (128, 256) if block else (7, 2048)
    w = torch.randn(2 * half, k, generator=gen) * 0.05
    q, scale = _block_quantize(w) if block else quantize_weight_per_row(w)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(2 * half, generator=gen).to(torch.bfloat16)
    args = (x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    got = fp8_gemm(*args, gated=True).cpu()
    unfused = fp8_gemm(*args)
    assert got.shape == (1, half) and got.dtype == torch.bfloat16
    assert torch.equal(got, fused.silu_and_mul(unfused).cpu())
    gate, up = unfused.cpu().float().chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=2e-2, atol=1e-2)
    with pytest.raises(ValueError, match="GEMV"):
        fp8_gemm(x.repeat(2, 1).to(DEVICE), *args[1:], gated=True)


@needs_triton
@pytest.mark.parametrize(
    "block, cache_dtype, slot",
    [(False, torch.bfloat16, 6), (False, FP8, 13), (True, torch.float8_e5m2, 2), (False, FP8, -1)],
)
def test_fp8_gemv_qkv_is_gemv_rotary_and_cache_write(block, cache_dtype, slot):
    """q | k | v with rotary and the cache write in the GEMV's epilogue (batch-1 attention):
    q and the whole cache bit for bit what the GEMV, `fused.rotary` and `reshape_and_cache`
    give one after the other, bias and k / v scales included; GQA (4 q heads, 2 kv heads),
    per-row and block scales, bf16 and both fp8 caches; slot -1 (padding) writes nothing."""
    from pagellm.kernels import fused
    from pagellm.kernels.fp8_gemm import fp8_gemm, fp8_gemv_qkv
    from pagellm.kernels.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, k = 4, 2, 32, 128
    n = (heads + 2 * kv_heads) * d
    w = torch.randn(n, k, generator=gen) * 0.05
    q8, scale = _block_quantize(w) if block else quantize_weight_per_row(w)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    angles = 11.0 / 10000 ** (torch.arange(0, d, 2) / d)  # position 11
    cos_sin = torch.cat([angles.cos(), angles.sin()]).to(torch.bfloat16).view(1, 1, d)
    cache = (torch.randn(2, 3, 8, kv_heads, d, generator=gen) * 4).to(cache_dtype)
    slots, kv_scale = torch.tensor([slot]), torch.tensor([0.5, 3.0])
    args = [t.to(DEVICE) for t in (x, q8, scale, bias)]
    want_cache = cache.to(DEVICE, copy=True)
    qkv = fp8_gemm(*args).view(1, -1, d)
    qk = fused.rotary(qkv[:, : heads + kv_heads], cos_sin.to(DEVICE))
    if slot >= 0:
        k_rows, v_rows = qk[:, heads:], qkv[:, heads + kv_heads :]
        reshape_and_cache(k_rows, v_rows, want_cache, slots.to(DEVICE), kv_scale.to(DEVICE))
    got_cache = cache.to(DEVICE, copy=True)
    q = fp8_gemv_qkv(*args, cos_sin.to(DEVICE), heads, kv_heads, got_cache, slots.to(DEVICE),
                     kv_scale.to(DEVICE))  # fmt: skip
    assert q.shape == (1, heads, d) and torch.equal(q, qk[:, :heads])
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert slot < 0 or not torch.equal(got_cache.view(torch.uint8).cpu(), cache.view(torch.uint8))
    with pytest.raises(ValueError, match="heads"):
        fp8_gemv_qkv(*args, cos_sin.to(DEVICE), heads + 1, kv_heads, got_cache, slots.to(DEVICE))


@needs_triton
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fp8_gemm_matches_dequantized_matmul(block, w8a8, rows):
    from pagellm.kernels.fp8_gemm import fp8_gemm, quantize_fp8

    gen = torch.Generator().manual_seed(2)
    n, k = 200, 256  # a partial 128-row block, and N not a multiple of the tile
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = _block_quantize(w) if block else quantize_weight_per_row(w)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    args = [t.to(DEVICE) for t in (q, scale, bias)]
    if w8a8:
        xq, xs = quantize_fp8(x.to(DEVICE), 128 if block else None)
        x_ref = xq.float().cpu().view(rows, -1, 128 if block else k) * xs.cpu()[..., None]
        got = fp8_gemm(xq, args[0], args[1], args[2], xs, out_dtype=torch.float32)
        want = F.linear(x_ref.view(rows, k), dequantize_fp8(q, scale), bias)
    else:
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # numpy has no bf16
        got = fp8_gemm(x.to(DEVICE, dtype), *args, out_dtype=torch.float32)
        want = F.linear(x.to(dtype).float(), dequantize_fp8(q, scale), bias)
    tol = 2e-2 if DEVICE == "cuda" else 1e-4
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


def _on_fp8_grid(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose fp8 quantization is exact (see test_quantize_fp8_activations)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8).view(FP8).float()
    grid = grid.nan_to_num(0.0)
    grid[:, ::128] = 448.0
    return grid * 2.0 ** torch.randint(-8, -2, (rows, 1), generator=gen).float()


@needs_triton
@pytest.mark.parametrize("block", [False, True])
def test_fp8_weight_dispatch(block):
    """`Fp8Weight` as a layer calls it: decode rows weight-only, larger batches w8a8
    (`torch._scaled_mm` for per-row scales, which also runs on the CPU)."""
    from pagellm.quantization.fp8 import MAX_TRITON_ROWS, Fp8Weight

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(160, 256, generator=gen) * 0.05
    q, scale = _block_quantize(w) if block else quantize_weight_per_row(w)
    bias = torch.randn(160, generator=gen)
    weight = Fp8Weight(q.to(DEVICE), scale.to(DEVICE))
    for rows in (1, MAX_TRITON_ROWS + 4):
        x = _on_fp8_grid(rows, 256, seed=rows)
        got = weight(x.to(DEVICE), bias.to(DEVICE)).float().cpu()
        want = F.linear(x, dequantize_fp8(q, scale), bias)
        # exact products; Hopper's fp8 tensor cores (w8a8 rows) sum them with fewer bits
        # than float32 (seen on an H200: up to 3.5e-4 of the largest output)
        w8a8_on_cuda = rows > MAX_TRITON_ROWS and DEVICE == "cuda"
        atol = (2e-3 if w8a8_on_cuda else 1e-4) * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)


@needs_triton
def test_fp8_gemm_checks_its_inputs():
    from pagellm.kernels.fp8_gemm import fp8_gemm

    w, s = quantize_weight_per_row(torch.randn(32, 64))
    with pytest.raises(ValueError, match="w_scale must be float32"):
        fp8_gemm(torch.randn(1, 64), w, s[:8])
    with pytest.raises(ValueError, match="needs x_scale"):
        fp8_gemm(torch.randn(1, 64).to(FP8), w, s)


# ---------------------------------------------------------------- checkpoints

TINY_FP8 = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_fp8_checkpoint(folder: str, scheme: str) -> dict[str, torch.Tensor]:
    """Quantize the folder's projections in place (`scheme`: block | tensor | channel) and
    return the dequantized weights the reference model should use."""
    state = load_file(os.path.join(folder, "model.safetensors"))
    dequantized = {}
    for name in [n for n in state if n.rpartition(".")[0].endswith(LINEARS)]:
        w = state.pop(name)
        stem = name.removesuffix(".weight")
        if scheme == "block":
            q, scale = _block_quantize(w)
            state[f"{stem}.weight_scale_inv"] = scale
        elif scheme == "tensor":
            scale = w.abs().max() / 448.0
            q = (w / scale).to(FP8)
            state[f"{stem}.weight_scale"] = scale.reshape(())
            state[f"{stem}.input_scale"] = torch.tensor(0.05)  # static: read and dropped
        else:
            q, scale = quantize_weight_per_row(w)
            state[f"{stem}.weight_scale"] = scale[:, None]  # compressed-tensors: [N, 1]
        state[name] = q
        dequantized[name] = dequantize_fp8(q, scale.reshape(-1) if scheme != "block" else scale)
    save_file(state, os.path.join(folder, "model.safetensors"))
    _add_quantization_config(folder, scheme)
    return dequantized


def _add_quantization_config(folder: str, scheme: str) -> None:
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    if scheme == "channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        group = {"weights": weights, "targets": ["Linear"]}
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"],
        }  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if scheme == "block":
            config["quantization_config"]["weight_block_size"] = [128, 128]
    json.dump(config, open(path, "w"))


@pytest.mark.parametrize("scheme", ["block", "tensor", "channel"])
def test_fp8_checkpoint_loads_on_cpu_dequantized(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model("llama", tmp_path, std=0.1, **TINY_FP8)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    deq = _write_fp8_checkpoint(folder, scheme)
    hf.load_state_dict(deq, strict=False)
    model = load_our_model(folder, quantization=None)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_weight is None and qkv.weight.dtype == torch.float32  # dequantized
    assert not hasattr(qkv, "weight_scale") or qkv.weight_scale is None
    fed, got = run_paged(model, [[3, 17, 99, 250, 7]], num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


TINY_FP8_MOE = dict(TINY_FP8, head_dim=64, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2)  # fmt: skip


def _fp8_moe_checkpoint(tmp_path, scheme: str) -> tuple[str, str]:
    """(fp8 folder, float reference folder with the same dequantized weights) of a tiny
    Qwen3-MoE stored as Qwen3-30B-A3B-FP8 is: every expert's projections fp8 with their own
    scales, the router in the model dtype."""
    folder = make_tiny_hf_model("qwen3_moe", tmp_path, std=0.1, **TINY_FP8_MOE)
    reference = str(shutil.copytree(folder, tmp_path / "reference"))
    dequantized = _write_fp8_checkpoint(folder, scheme)
    state = load_file(os.path.join(reference, "model.safetensors")) | dequantized
    save_file(state, os.path.join(reference, "model.safetensors"))
    return folder, reference


@pytest.mark.parametrize("scheme", ["block", "tensor", "channel"])
def test_fp8_moe_checkpoint_loads_its_experts_dequantized(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    folder, reference = _fp8_moe_checkpoint(tmp_path, scheme)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model = load_our_model(folder, quantization=None)
    mlp = model.model.layers[0].mlp
    assert mlp.gate.quant_method is None and mlp.gate.weight.dtype == torch.float32
    assert mlp.experts.w13.dtype == torch.float32
    fed, got = run_paged(model, [[3, 17, 99, 250, 7]], num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


def test_fp8_moe_expert_without_its_scale_is_a_clear_error(tmp_path):
    folder, _ = _fp8_moe_checkpoint(tmp_path, "block")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj.*only \['weight'\]"):
        load_our_model(folder, quantization=None)


def test_fp8_checkpoint_refuses_other_methods(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path, std=0.1, **TINY_FP8)
    _add_quantization_config(folder, "block")
    from pagellm import EngineArgs

    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'fp8'"):
        EngineArgs(model=folder, quantization="int4", device="cpu").create_engine_config()
    config = json.load(open(os.path.join(folder, "config.json")))
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' are not supported"):
        resolve_quantization(None, type("C", (), config)(), "hf", torch.device("cpu"))


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_fp8_gemm_at_llama_shapes_matches_scaled_mm(rows, shape):
    from pagellm.kernels.fp8_gemm import fp8_gemm, quantize_fp8

    n, k = shape
    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale = quantize_weight_per_row(w)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_fp8(x)
    want = torch._scaled_mm(
        xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16
    ).float()
    for got in (fp8_gemm(x, q, scale), fp8_gemm(xq, q, scale, x_scale=xs)):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max())
    bq, bs = _block_quantize(w.cpu())
    bq, bs = bq.cuda(), bs.cuda()
    xq, xs = quantize_fp8(x, 128)
    want = F.linear(x.float(), dequantize_fp8(bq, bs))
    for got in (fp8_gemm(xq, bq, bs, x_scale=xs), fp8_gemm(x, bq, bs)):  # w8a8, weight-only
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_fp8_checkpoint_on_cuda_agrees_with_dequantized(tmp_path, scheme):
    """The checkpoint as stored (fp8 kernels) against its dequantized weights. At most 4
    requests a step keep every GEMM on the weight-only kernels (<= 16 rows: bf16 activations,
    the exact fp8 weight times its scale), so the runs differ only by the dequantized copy's
    bf16 rounding; with more rows activations are quantized per token, whose error flips
    the near-tied argmaxes of a random tiny model (12 of 24 agreed with 24 at once)."""
    from pagellm import LLM, SamplingParams

    folder = make_tiny_hf_model("llama", tmp_path, **TINY_FP8)
    _write_fp8_checkpoint(folder, scheme)
    prompts = [{"prompt_token_ids": [3, 17, 99, 250 + i]} for i in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for quantization in (None, "none"):
        with LLM(model=folder, quantization=quantization, max_model_len=256, max_num_seqs=4) as llm:
            runs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(a[:4] == b[:4] for a, b in zip(runs[None], runs["none"]))
    assert same >= 20, same


@needs_triton
def test_batch1_decode_with_qkv_into_cache_is_the_unfused_path(tmp_path, monkeypatch):
    """A model whose q | k | v weights are fp8 (`Fp8Weight`) on the Triton attention backend
    (interpreted on the CPU): its one-token decodes project, rotate and write the cache in
    one kernel, and give the logits of the unfused GEMV -> rotary -> cache write, bit for
    bit; the prefill (5 rows) takes the unfused path."""
    from pagellm.attention.triton_backend import TritonAttentionBackend
    from pagellm.quantization.fp8 import Fp8Weight

    shape = {**TINY_FP8, "num_attention_heads": 4, "num_hidden_layers": 1}  # GQA: 2 kv heads
    folder = make_tiny_hf_model("llama", tmp_path, **shape)
    model = load_our_model(folder, torch.bfloat16, device=DEVICE,
                           attn_backend_cls=TritonAttentionBackend)  # fmt: skip
    for layer in model.model.layers:
        qkv = layer.self_attn.qkv_proj
        qkv.packed_weight = Fp8Weight(*quantize_weight_per_row(qkv.weight.float()))
    fused, fused_rows = Fp8Weight.qkv_rotary_into_cache, []

    def counted(weight, x, *args):
        q = fused(weight, x, *args)
        fused_rows.append(x.shape[0] if q is not None else 0)
        return q

    monkeypatch.setattr(Fp8Weight, "qkv_rotary_into_cache", counted)
    prompts = [[3, 17, 99, 250, 7]]
    [(tokens, logits)] = run_paged(model, prompts, num_decode_steps=2)
    assert fused_rows == [0, 1, 1]
    monkeypatch.setattr(Fp8Weight, "qkv_rotary_into_cache", lambda *args: None)
    [(tokens_apart, logits_apart)] = run_paged(model, prompts, num_decode_steps=2)
    assert tokens == tokens_apart and torch.equal(logits, logits_apart)


@needs_triton
@pytest.mark.parametrize("block", [False, True])
def test_prefill_takes_its_fp8_inputs_from_the_norm_and_activation_kernels(
    tmp_path, monkeypatch, block
):
    """Every projection fp8 (`Fp8Weight`, per-row or 128x128-block scales): a 20-token
    prefill (w8a8: more than MAX_TRITON_ROWS rows) gets the q | k | v and gate | up inputs
    from the RMSNorm kernels and down_proj's from the SiLU-and-mul kernel, already quantized
    (`QuantizedActivation`: per token, or per 128 columns for block weights), and gives the
    logits of the unfused norm -> quantize_fp8 -> GEMM path, bit for bit; the decodes (one
    row) take bf16 inputs."""
    from pagellm.attention.triton_backend import TritonAttentionBackend
    from pagellm.kernels import fused
    from pagellm.layers import fused_ops
    from pagellm.quantization.fp8 import Fp8Weight

    folder = make_tiny_hf_model("llama", tmp_path, **{**TINY_FP8, "num_hidden_layers": 1})
    model = load_our_model(folder, torch.bfloat16, device=DEVICE,
                           attn_backend_cls=TritonAttentionBackend)  # fmt: skip
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):  # fmt: skip
            quantize = _block_quantize if block else quantize_weight_per_row
            linear.packed_weight = Fp8Weight(*quantize(linear.weight.float()))
    monkeypatch.setattr(fused_ops, "ops_for", lambda x: fused)  # the CPU's own ops round apart
    calls = []
    for name in ("rms_norm_fp8", "silu_and_mul_fp8"):
        kernel = getattr(fused, name)

        def counted(*args, _kernel=kernel, _name=name):  # (name, rows, group)
            calls.append((_name, args[0].shape[0], args[-1]))
            return _kernel(*args)

        monkeypatch.setattr(fused, name, counted)
    prompts = [list(range(3, 23))]
    [(tokens, logits)] = run_paged(model, prompts, num_decode_steps=1)
    # the layer's two norms and its activation, on the prefill's 20 rows only
    group = 128 if block else 0  # the last argument of both
    assert sorted(calls) == [("rms_norm_fp8", 20, group)] * 2 + [("silu_and_mul_fp8", 20, group)]
    monkeypatch.setattr(Fp8Weight, "input_quantization", lambda self, rows: None)
    [(tokens_apart, logits_apart)] = run_paged(model, prompts, num_decode_steps=1)
    assert tokens == tokens_apart and torch.equal(logits, logits_apart)


@pytest.mark.gpu
def test_fp8_dummy_llama_8b_runs():
    from pagellm import LLM, SamplingParams

    with LLM(model="llama-3.1-8b", load_format="dummy", quantization="fp8",
             max_model_len=1024) as llm:  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": list(range(100, 164))}] * 3,
            SamplingParams(max_tokens=8, ignore_eos=True),
        )
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
