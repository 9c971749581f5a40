"""gpt-oss's experts in the fused-MoE Triton kernels (HAS_BIAS: biased gate | up and down
GEMMs; CLAMPED: the clamped SwiGLU in the gate_up epilogue; MXFP4 weights dequantized in
registers) against the torch path of `pagellm/layers/moe.py` (`experts_torch` with the same
biases and `ClampedSwiGLU`, on the weights the MXFP4 packing encodes): under Triton's
interpreter on tiny shapes without CUDA, bf16 at gpt-oss-20b's shapes with it. And the
MXFP4 checkpoint kept as stored (`Mxfp4Config`, CUDA's path) through the whole tiny model,
its logits equal HF's on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from mxfp4_pack import pack_mxfp4
from test_fused_moe import (  # sets the interpreter
    DEVICE,
    DTYPES,
    TINY,
    TINY_GEMV,
    _close,
    _problem,
    _randn,
)

from pagellm.kernels import fused_moe as fm
from pagellm.kernels import fused_moe_quant as fq
from pagellm.layers.activation import ClampedSwiGLU
from pagellm.layers.moe import experts_torch


def _biases(e, h, i, dtype, seed=0):
    return _randn(e, 2 * i, dtype=dtype, seed=seed + 10), _randn(e, h, dtype=dtype, seed=seed + 11)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_fused_moe_bias_and_clamped_swiglu(dtype, num_tokens):
    """A limit of 0.5 clamps most gates and ups at these scales: both clamps and both
    biases matter (checked: without them the outputs differ)."""
    x, w13, w2, weights, ids = _problem(num_tokens, 4, 64, 32, dtype, seed=3)
    bias13, bias2 = _biases(4, 64, 32, dtype)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    out = fm.fused_moe(x, w13, w2, weights, ids, TINY, bias13, bias2, act)
    ref = experts_torch(x, w13, w2, weights, ids, bias13, bias2, act)
    _close(out, ref, dtype)
    plain = experts_torch(x, w13, w2, weights, ids, bias13, bias2, ClampedSwiGLU(1.702, 1e4))
    assert (plain - ref).abs().max() > 0.05
    assert (experts_torch(x, w13, w2, weights, ids, activation=act) - ref).abs().max() > 0.05


def test_fused_moe_rejects_a_bias_of_the_wrong_shape():
    x, w13, w2, weights, ids = _problem(3, 4, 64, 32, torch.float32)
    bias13, bias2 = _biases(4, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="fused_moe: bias"):
        fm.fused_moe(x, w13, w2, weights, ids, TINY, bias13[:, :10].contiguous(), bias2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_bf16_at_gpt_oss_20b_shapes(num_tokens):
    """32 experts, top-4, H = I = 2880, biases, the clamped SwiGLU (limit 7): against the
    torch path in float32."""
    x, w13, w2, weights, ids = _problem(num_tokens, 32, 2880, 2880, torch.bfloat16, top_k=4)
    bias13, bias2 = _biases(32, 2880, 2880, torch.bfloat16)
    act = ClampedSwiGLU()
    out = fm.fused_moe(x, w13, w2, weights, ids, None, bias13, bias2, act)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids, bias13.float(),
                        bias2.float(), act)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def _mxfp4_stack(w: torch.Tensor) -> tuple[fq.QuantizedStack, torch.Tensor]:
    """[E, N, K] float -> its MXFP4 stack on DEVICE and the float32 weight it encodes."""
    blocks, scales, encoded = pack_mxfp4(w.float().to(DEVICE))
    q = blocks.reshape(*blocks.shape[:2], -1).contiguous()
    return fq.QuantizedStack(q, scales, None, 4, 32, mxfp4=True), encoded


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,config",
    [(1, TINY), (13, TINY), (1, TINY_GEMV), (3, None), (2, fq.GemvConfig(16, 128, 2)), (13, None)],
)
def test_fused_moe_mxfp4_bias_and_clamped_swiglu(dtype, num_tokens, config):
    """K = 64 (two groups a row) and 32; each weight's code, sign and scale read back; by the
    tiled kernel (TINY's tiles; MXFP4_CONFIGS' by default at 13 tokens) and the GEMV (K steps
    of 32, of 64 by default, of 128: the tail masked)."""
    x, w13, w2, weights, ids = _problem(num_tokens, 4, 64, 32, dtype, seed=5)
    (q13, d13), (q2, d2) = _mxfp4_stack(w13), _mxfp4_stack(w2)
    bias13, bias2 = _biases(4, 64, 32, dtype)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, config, bias13, bias2, act)
    ref = experts_torch(x, d13.to(dtype), d2.to(dtype), weights, ids, bias13, bias2, act)
    _close(out, ref, dtype)


@pytest.mark.parametrize("config", [fq.GemvConfig(16, 64, 4), TINY_GEMV])
def test_mxfp4_gemv_masks_the_k_tail(config):
    """H = 96 (three groups): K steps of 64 leave half a step, of 32 none; I = 32."""
    x, w13, w2, weights, ids = _problem(2, 4, 96, 32, torch.float32, seed=7)
    (q13, d13), (q2, d2) = _mxfp4_stack(w13), _mxfp4_stack(w2)
    bias13, bias2 = _biases(4, 96, 32, torch.float32)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, config, bias13, bias2, act)
    ref = experts_torch(x, d13, d2, weights, ids, bias13, bias2, act)
    _close(out, ref, torch.float32)


def test_fused_moe_mxfp4_rejects_bad_scales():
    x, w13, w2, weights, ids = _problem(3, 4, 64, 32, torch.float32)
    (q13, _), (q2, _) = _mxfp4_stack(w13), _mxfp4_stack(w2)
    bad = fq.QuantizedStack(q13.q, q13.scales[..., :1].contiguous(), None, 4, 32, mxfp4=True)
    with pytest.raises(ValueError, match="mxfp4 scales"):
        fq.fused_moe_quant(x, bad, q2, weights, ids, TINY)


def test_mxfp4_kept_as_stored_through_the_model(tmp_path, monkeypatch):
    """The tiny MXFP4 gpt-oss loaded as on CUDA (`Mxfp4Config`: blocks and scales as stored,
    gate | up rows de-interleaved), run on the CPU under the interpreter: every layer's
    experts are the MXFP4 kernel's and the logits equal HF's on the dequantized weights."""
    from model_utils import hf_logits, load_our_model, run_paged
    from test_gpt_oss import GPT_OSS, _prompts
    from test_mxfp4 import mxfp4_and_hf

    from pagellm.loader import model_loader
    from pagellm.quantization.mxfp4 import Mxfp4Config, Mxfp4GpuExperts

    folder, hf = mxfp4_and_hf(tmp_path, num_hidden_layers=2,
                              layer_types=GPT_OSS["layer_types"][:2])  # fmt: skip
    monkeypatch.setattr(model_loader, "get_quant_config", lambda *_: Mxfp4Config())
    ours = load_our_model(folder)
    assert all(
        isinstance(layer.mlp.experts.quantized_experts, Mxfp4GpuExperts)
        for layer in ours.model.layers
    )
    for tokens, logits in run_paged(ours, _prompts()[:2], num_decode_steps=2, chunk_size=8):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_mxfp4_bf16_at_gpt_oss_20b_shapes(num_tokens):
    """32 experts, top-4, H = I = 2880 (90 groups a row), MXFP4 weights, biases, the
    clamped SwiGLU: against the torch path on the encoded weights in float32."""
    x, w13, w2, weights, ids = _problem(num_tokens, 32, 2880, 2880, torch.bfloat16, top_k=4)
    (q13, d13), (q2, d2) = _mxfp4_stack(w13), _mxfp4_stack(w2)
    bias13, bias2 = _biases(32, 2880, 2880, torch.bfloat16)
    out = fq.fused_moe_quant(x, q13, q2, weights, ids, None, bias13, bias2, ClampedSwiGLU())
    ref = experts_torch(x.float(), d13.bfloat16().float(), d2.bfloat16().float(), weights, ids,
                        bias13.float(), bias2.float(), ClampedSwiGLU())  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_dummy_mxfp4_experts(tmp_path, monkeypatch):
    """load_format="dummy" with quantization="mxfp4" (a shipped config has no
    quantization_config): random MXFP4 codes and scales at the layer's layout, served."""
    from model_utils import load_our_model, make_tiny_hf_model, run_paged
    from test_gpt_oss import GPT_OSS, _prompts

    from pagellm.loader import model_loader
    from pagellm.quantization.mxfp4 import Mxfp4Config, Mxfp4GpuExperts

    folder = make_tiny_hf_model("gpt_oss", tmp_path, **GPT_OSS)
    monkeypatch.setattr(model_loader, "get_quant_config", lambda *_: Mxfp4Config())
    ours = load_our_model(folder, load_format="dummy", quantization="mxfp4")
    experts = ours.model.layers[0].mlp.experts
    assert isinstance(experts.quantized_experts, Mxfp4GpuExperts)
    assert experts.w13_blocks.dtype == torch.uint8 and experts.w13_blocks.shape == (4, 256, 2, 16)
    assert len(experts.w2_scales.unique()) > 1  # drawn, not left empty
    for _, logits in run_paged(ours, _prompts()[:1], num_decode_steps=1):
        assert torch.isfinite(logits).all()


def test_mxfp4_kept_as_stored_names_a_malformed_tensor(tmp_path, monkeypatch):
    """As stored (CUDA's path), a blocks tensor of another dtype or shape names itself."""
    from model_utils import load_our_model, make_tiny_hf_model
    from safetensors.torch import load_file, save_file
    from test_gpt_oss import GPT_OSS
    from test_mxfp4 import write_mxfp4_folder

    from pagellm.loader import model_loader
    from pagellm.quantization.mxfp4 import Mxfp4Config

    folder = make_tiny_hf_model("gpt_oss", tmp_path, **GPT_OSS)
    write_mxfp4_folder(folder, tmp_path / "mxfp4")
    monkeypatch.setattr(model_loader, "get_quant_config", lambda *_: Mxfp4Config())
    path = str(tmp_path / "mxfp4" / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors = load_file(path)
    for bad, message in ((tensors[name].to(torch.int16), "expected uint8"),
                         (tensors[name][:, :, :1].contiguous(), "expected")):  # fmt: skip
        save_file({**tensors, name: bad}, path)
        with pytest.raises(ValueError, match=f"{name}.*{message}"):
            load_our_model(str(tmp_path / "mxfp4"))
    # a scale the kernels cannot hold in float32 (2^(s - 127) * 2^14 overflows above 240)
    name = name.replace("_blocks", "_scales")
    huge = tensors[name].clone()
    huge[0, 0, 0] = 241
    save_file({**tensors, name: huge}, path)
    with pytest.raises(ValueError, match=f"{name}: a scale byte of 241 .* at most 240"):
        load_our_model(str(tmp_path / "mxfp4"))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_mxfp4_model_on_cuda_equals_hf(tmp_path):
    """The tiny MXFP4 gpt-oss on CUDA in float32, as a user loads it (`Mxfp4Config` from the
    checkpoint: experts as stored, the Triton attention with sinks and the MXFP4 fused MoE):
    every position's logits equal HF's on the dequantized weights."""
    from model_utils import hf_logits, load_our_model, run_paged
    from test_gpt_oss import _prompts
    from test_mxfp4 import mxfp4_and_hf

    from pagellm.attention.triton_backend import TritonAttentionBackend
    from pagellm.quantization.mxfp4 import Mxfp4GpuExperts

    folder, hf = mxfp4_and_hf(tmp_path)
    ours = load_our_model(folder, device="cuda", attn_backend_cls=TritonAttentionBackend)
    assert isinstance(ours.model.layers[0].mlp.experts.quantized_experts, Mxfp4GpuExperts)
    for tokens, logits in run_paged(ours, _prompts(), num_decode_steps=4, chunk_size=16):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=2e-3, rtol=1e-3)
