"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (W4A16 / W8A16) on the CPU.

Tiny random models of several families are packed into each format by `wna16_pack.py`
(from each format's spec; compressed-tensors by its own packer) beside a float checkpoint of
the same weights dequantized. Our model on the packed folder, with its int weights kept (the
block kernel) or dequantized at load (quantization="none"), gives the logits HF gives on the
float folder (float32: within 1e-4; the block kernel's products are exact, only their order
of summation differs); an engine on it gives the float folder's greedy ids. Layouts the
kernel cannot take (act-order parts that disagree, asymmetric 8-bit) are dequantized; bad
tensors, configs and tensor-parallel splits are clear errors. Triton kernels: see
test_wna16_gemm.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import hf_logits, load_our_model, make_tiny_hf_model, run_paged
from safetensors.torch import load_file, save_file
from wna16_pack import Packing, format_tensors, quantization_config, quantize, quantize_folder

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.distributed.parallel_state import building_rank
from pagellm.quantization import gguf_kernel
from pagellm.quantization.base import quant_config_dict
from pagellm.quantization.gguf_kernel import BlockPlanes
from pagellm.quantization.wna16_cpu import block_planes
from pagellm.quantization.wna16_formats import (
    default_config,
    dequantize,
    parse_scheme,
    to_canonical,
)

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
BLOCKS = gguf_kernel.supported()
CASES = {  # (family, packing): int weights kept where the block kernel runs (4-bit; 8-bit sym)
    "llama-gptq-sym-g32": ("llama", Packing("gptq", 4, 32), True),
    "qwen2-gptq-asym-g64-actorder": ("qwen2", Packing("gptq", 4, 64, False, True), True),
    "mistral-gptq-actorder-parts-differ": (
        "mistral", Packing("gptq", 4, 32, True, True, shared_order=False), False),
    "qwen3-gptq_v2-8bit-channel": ("qwen3", Packing("gptq_v2", 8, -1), True),
    "llama-gptq-8bit-asym-g128": ("llama", Packing("gptq", 8, 128, False), False),
    "phi3-awq-g32": ("phi3", Packing("awq", 4, 32, False), True),
    "gemma2-awq-g128": ("gemma2", Packing("awq", 4, 128, False), True),
    "qwen2-ct-w4a16-asym-g32-actorder": (
        "qwen2", Packing("compressed-tensors", 4, 32, False, True), True),
    "llama-ct-w4a16-sym-channel": ("llama", Packing("compressed-tensors", 4, -1), True),
    "qwen3-ct-w8a16-sym-g64": ("qwen3", Packing("compressed-tensors", 8, 64), True),
    "starcoder2-gptq-sym-g64": ("starcoder2", Packing("gptq", 4, 64), True),  # biased c_fc
}  # fmt: skip


def _packed(tmp_path, arch: str, packing: Packing, **overrides) -> tuple[str, str]:
    """(packed folder, float reference folder)."""
    folder = make_tiny_hf_model(arch, tmp_path, std=0.1, **{**TINY, **overrides})
    reference = str(tmp_path / "reference")
    quantize_folder(folder, reference, packing)
    return folder, reference


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_dequantized_models(case, tmp_path):
    from transformers import AutoModelForCausalLM

    arch, packing, kept = CASES[case]
    folder, reference = _packed(tmp_path, arch, packing)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    for quantization in (None, "none"):
        model = load_our_model(folder, quantization=quantization)
        qkv = model.model.layers[0].self_attn.qkv_proj
        on_blocks = quantization is None and kept and BLOCKS
        assert (type(qkv.packed_weight).__name__ == "WNA16BlockWeight") == on_blocks
        assert on_blocks or qkv.weight.dtype == torch.float32  # dequantized at load
        fed, got = run_paged(model, [[3, 17, 99, 250, 7]], num_decode_steps=3)[0]
        torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not BLOCKS, reason="the block kernel needs AVX-512 or AVX2, and a compiler")
@pytest.mark.parametrize("case", ["qwen2-gptq-asym-g64-actorder", "qwen3-ct-w8a16-sym-g64"])
def test_without_dense_copies_prefill_dequantizes_the_blocks(case, tmp_path, monkeypatch):
    """PAGELLM_CPU_QUANT_DENSE_COPY=0: a prefill of more rows than the blocks take runs on the
    blocks dequantized per call (act-order: x gathered into the blocks' column order), and
    gives HF's logits on the float folder, as the decode steps after it do."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGELLM_CPU_QUANT_DENSE_COPY", "0")
    arch, packing, _ = CASES[case]
    folder, reference = _packed(tmp_path, arch, packing)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model = load_our_model(folder)
    weight = model.model.layers[0].mlp.down_proj.packed_weight
    assert type(weight).__name__ == "WNA16BlockWeight" and weight.dense is None
    prompt = [3, 17, 99, 250, 7, 41, 12, 88, 5, 130, 64, 9, 201] * 3  # 39 rows > 32
    fed, got = run_paged(model, [prompt], num_decode_steps=3)[0]
    torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["qwen2-gptq-asym-g64-actorder", "phi3-awq-g32"])
def test_engine_greedy_ids_equal_the_dequantized_models(case, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    arch, packing, _ = CASES[case]
    _engine_ids_match(*_packed(tmp_path, arch, packing), prompts=6, tokens=12)


def _engine_ids_match(folder: str, reference: str, prompts: int, tokens: int) -> None:
    """The engine's greedy ids on the packed folder equal those on its dequantized twin."""
    requests = [{"prompt_token_ids": [3, 17 + i, 99, 250, 7 + i]} for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = {}
    for path in (folder, reference):
        with LLM(model=path, dtype="float32", max_model_len=128, max_num_seqs=4) as llm:
            ids[path] = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    assert ids[folder] == ids[reference]


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "packing",
    [Packing("awq", 4, 32, False), Packing("gptq", 4, 32, False), Packing("gptq", 8, 64),
     Packing("gptq_v2", 4, -1, False), Packing("compressed-tensors", 4, 32, False),
     Packing("compressed-tensors", 8, -1, False)],
    ids=lambda p: f"{p.method}-{p.bits}bit-g{p.group}-{'sym' if p.sym else 'asym'}",
)  # fmt: skip
def test_each_format_reads_back_its_integers(packing):
    """Every stored integer and scale lands where the canonical layout says (N = 40: the
    compressed-tensors zero points' last int32 holds 5 rows, not 8). Every third row is
    positive: asymmetric zero points of 0, which GPTQ v1's zero - 1 borrows across fields."""
    w = torch.randn(40, 128)
    w[::3] = w[::3].abs()
    q, scale, zero, _ = quantize(w, packing)
    tensors, _ = format_tensors("m", w, packing)
    scheme = parse_scheme(quantization_config(packing))
    canon = {}
    for name, tensor in tensors.items():
        role = {v: k for k, v in scheme.names.items()}.get(name[2:])
        if role:
            canon[role] = to_canonical(scheme, role, name, tensor, 40, 128)
    zeros = canon.get("zeros", torch.full_like(zero, scheme.offset)).long()
    assert torch.equal(zeros, zero) and torch.equal(canon["scales"], scale)
    group = torch.arange(128) // scheme.group(128)
    deq = dequantize(canon["qweight"], canon["scales"], zeros.to(torch.uint8), packing.bits,
                     scheme.group(128))  # fmt: skip
    assert torch.equal(deq, (q - zero[:, group]).float() * scale[:, group])


@pytest.mark.skipif(not BLOCKS, reason="the block kernel does not run here")
@pytest.mark.parametrize("k, group", [(256, 32), (256, 128), (288, 96), (256, 256), (576, 128)])
def test_block_kernel_on_groups_with_float32_offsets(k, group):
    """Asymmetric groups as blocks: w = d q + m with m = -zero * scale kept in float32 (in
    fp16 it would round), one d and m a group (read once for its blocks: 1, 4, 3 (an odd
    count of blocks, 9 a row) and 8 blocks); x @ w^T equals the dequantized product up to
    summation order for float32 x, bf16 x (then rounded once) and x rounded to int8 blocks
    where the CPU takes it; the planes dequantized are the weights bit for bit."""
    p = Packing("gptq", 4, group, False)
    w = torch.randn(48, k)
    q, scale, zero, _ = quantize(w, p)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # canonical nibbles
    planes = block_planes(qweight, scale, zero.to(torch.uint8), 4, group)
    assert planes is not None and planes.m.dtype == torch.float32
    assert planes.group_blocks == group // 32 and planes.d.shape == (48, -(-k // group))
    dense = dequantize(qweight, scale, zero.to(torch.uint8), 4, group)
    assert torch.equal(gguf_kernel.dequantize_into_scratch(planes, torch.float32), dense)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ dense.double().t()
        tol = dict(rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(gguf_kernel.block_gemm(x, planes).double(), want, **tol)
        want = x.bfloat16().double() @ dense.double().t()
        got = gguf_kernel.block_gemm(x.bfloat16(), planes).double()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    if gguf_kernel.int8_dots_supported():  # x as int8 blocks: the rounded x's product
        x = torch.randn(2, k)
        xb = x.view(2, -1, 32)
        amax = xb.abs().amax(-1, keepdim=True)
        x8 = (torch.round(xb * 127.0 / amax) * (amax / 127.0)).view(2, k)
        int8_planes = BlockPlanes(planes.qs, planes.d, planes.m, True, planes.group_blocks)
        want = x8.double() @ dense.double().t()
        torch.testing.assert_close(gguf_kernel.block_gemm(x, int8_planes).double(), want,
                                   rtol=1e-4, atol=1e-4 * float(want.abs().max()))  # fmt: skip
    assert block_planes(qweight[:, :40], scale[:, :1], zero[:, :1].to(torch.uint8), 4, 80) is None


# ---------------------------------------------------------------- errors


def _write(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_corrupt_tensor_is_a_clear_error(tmp_path):
    folder, _ = _packed(tmp_path, "llama", Packing("gptq", 4, 32))
    name = "model.layers.1.mlp.down_proj.qweight"
    _write(folder, lambda s: s.__setitem__(name, s[name][:-1].contiguous()))
    with pytest.raises(ValueError, match=rf"{name}: expected GPTQ int32 qweight \[K / 8, N\] "
                       r"of shape \[32, 128\], got \[31, 128\]"):  # fmt: skip
        load_our_model(folder)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_qzeros_that_the_format_misreads_are_ignored(bits, tmp_path, caplog):
    """A symmetric GPTQ v1 checkpoint (zeros stored as 2^(bits-1) - 1) whose config says
    gptq_v2: its qzeros read 7 (127), not 8 (128). vLLM's kernels never read a symmetric
    layer's zeros, so neither do we: the dequantized model's logits, and a warning."""
    from transformers import AutoModelForCausalLM

    folder, reference = _packed(tmp_path, "llama", Packing("gptq", bits, 32))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    with open(config_path, "w") as f:
        json.dump(config, f)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model = load_our_model(folder, quantization="none")
    fed, got = run_paged(model, [[3, 17, 99, 250, 7]], num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)
    assert "sym: true, but its qzeros hold" in caplog.text


def test_wrong_scales_and_float_weights_are_clear_errors(tmp_path):
    folder, _ = _packed(tmp_path, "llama", Packing("awq", 4, 32, False))
    name = "model.layers.0.self_attn.k_proj.scales"
    _write(folder, lambda s: s.__setitem__(name, s[name][:, :-8].contiguous()))
    with pytest.raises(ValueError, match=rf"{name}: expected scales \[G, N\] of shape \[4, 64\]"):
        load_our_model(folder)
    folder, _ = _packed(tmp_path / "b", "llama", Packing("compressed-tensors", 4, 32))
    stem = "model.layers.0.mlp.up_proj"

    def to_float(state):
        del state[f"{stem}.weight_packed"]
        state[f"{stem}.weight"] = torch.zeros(256, 128)

    _write(folder, to_float)
    with pytest.raises(
        ValueError, match=rf"{stem}.weight: a float weight where .* 'weight_packed'"
    ):
        load_our_model(folder)


def _set_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.setdefault("quantization_config", {}).update(changes)
    json.dump(config, open(path, "w"))


def test_names_and_unsupported_configs(tmp_path):
    folder, reference = _packed(tmp_path, "llama", Packing("gptq", 4, 32))

    def resolve(path, name):
        return EngineArgs(model=path, quantization=name, device="cpu").create_engine_config()

    assert resolve(folder, "gptq_marlin").model_config.quantization == "gptq"
    assert resolve(folder, "none").model_config.quantization is None
    with pytest.raises(ValueError, match="quantization='awq' does not match .* 'gptq'"):
        resolve(folder, "awq")
    with pytest.raises(ValueError, match="quantization='gptq' needs a GPTQ checkpoint"):
        resolve(reference, "gptq")
    _set_config(folder, bits=3)
    with pytest.raises(ValueError, match="gptq: 3-bit weights are not supported"):
        load_our_model(folder)
    _set_config(folder, bits=4, group_size=64)  # the tensors' groups are of 32
    with pytest.raises(ValueError, match=r"g_idx puts the inputs in groups of 32, the gptq "
                                         r"config's group_size is 64"):  # fmt: skip
        load_our_model(folder)
    _set_config(folder, group_size=32, bits=4, dynamic={"+:model.layers.[": {"bits": 8}})
    with pytest.raises(ValueError, match=r"GPTQ dynamic rule '\+:model.layers.\[': not a regex"):
        load_our_model(folder)
    _set_config(folder, dynamic={".*layers.0.self_attn.k_proj": {"bits": 8}})
    with pytest.raises(ValueError, match=r"layers.0.self_attn.qkv_proj: the checkpoint's "
                                         r"per-module settings .* set the parts"):  # fmt: skip
        load_our_model(folder)
    folder, _ = _packed(tmp_path / "awq", "llama", Packing("awq", 4, 32, False))
    _set_config(folder, version="gemv")
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        load_our_model(folder)


# GPTQModel's per-module rules: the first match applies ("-:" leaves a module float); other
# settings (damp_percent) only mattered to the quantizer
DYNAMIC = {"-:model\\.layers\\.1\\.mlp\\.": {},
           "+:.*self_attn\\.o_proj": {"bits": 8, "group_size": 64, "damp_percent": 0.05},
           r".*down_proj": {"group_size": -1, "sym": False},
           "lm_head": {"bits": 8, "group_size": 128}}  # fmt: skip


def test_gptq_dynamic_rules_give_modules_their_own_settings(tmp_path, monkeypatch):
    """A GPTQModel checkpoint with `dynamic` rules (layer 1's MLP left float, o_proj 8-bit in
    groups of 64, down_proj channel-wise with zero points) and its LM head quantized
    (lm_head=True: 8-bit): each module read with its own settings; logits and the engine's
    greedy ids equal the dequantized model's."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model("llama", tmp_path, std=0.1, tie_word_embeddings=False, **TINY)
    reference = str(tmp_path / "reference")
    quantize_folder(folder, reference, Packing("gptq", 4, 32), dynamic=DYNAMIC, lm_head=True)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.weight" in stored  # left float by "-:"
    assert "model.layers.0.mlp.down_proj.qweight" in stored and "lm_head.qweight" in stored
    model = load_our_model(folder)
    layer0, layer1 = model.model.layers
    settings = {
        name: module.quant_method.scheme.key
        for name, module in (
            ("o", layer0.self_attn.o_proj),
            ("down", layer0.mlp.down_proj),
            ("qkv", layer1.self_attn.qkv_proj),
            ("head", model.lm_head),
        )
    }
    assert settings == {"o": (8, 64, True, False), "down": (4, -1, False, False),
                        "qkv": (4, 32, True, False), "head": (8, 128, True, False)}  # fmt: skip
    assert getattr(layer1.mlp.down_proj, "quant_method", None) is None  # float, as stored
    _logits_match(folder, reference)
    _engine_ids_match(folder, reference, prompts=4, tokens=10)


def test_compressed_tensors_config_groups_give_modules_their_own_settings(tmp_path):
    """llm-compressor's mixed recipes: several config groups, each module packed by the
    group whose target names it, else whose "re:" pattern matches it, else "Linear"; a
    recipe without "Linear" leaves the modules it does not target float."""
    ct = "compressed-tensors"
    mixed = {
        "group_0": (["Linear"], Packing(ct, 4, 32)),
        "group_1": (["re:.*down_proj$"], Packing(ct, 8, -1)),
        "group_2": (["model.layers.0.self_attn.o_proj"], Packing(ct, 4, 64, False)),
    }
    only = {"group_0": (["re:.*mlp\\.(gate|up)_proj"], Packing(ct, 4, 32, False))}
    want = {
        "mixed": {
            "o": (4, 64, False, False),
            "down": (8, -1, True, False),
            "qkv": (4, 32, True, False),
        },
        "only": {"o": None, "down": None, "qkv": None, "gate_up": (4, 32, False, False)},
    }
    for name, groups in (("mixed", mixed), ("only", only)):
        folder = make_tiny_hf_model("qwen2", tmp_path / name, std=0.1, **TINY)
        reference = str(tmp_path / name / "reference")
        quantize_folder(folder, reference, Packing(ct, 4, 32), groups=groups)
        layer = load_our_model(folder).model.layers[0]
        modules = {
            "o": layer.self_attn.o_proj,
            "down": layer.mlp.down_proj,
            "qkv": layer.self_attn.qkv_proj,
            "gate_up": layer.mlp.gate_up_proj,
        }
        got = {key: method.scheme.key if (method := getattr(m, "quant_method", None)) else None
               for key, m in modules.items() if key in want[name]}  # fmt: skip
        assert got == want[name]
        _logits_match(folder, reference)


# ---------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("packing", [Packing("gptq", 4, 32, False), Packing("awq", 4, 32, False),
                                     Packing("compressed-tensors", 4, 32, False, True),
                                     Packing("gptq", 8, -1)])  # fmt: skip
def test_each_rank_holds_its_rows_and_groups(packing, tmp_path):
    """Two ranks: column-parallel layers take their rows, row-parallel ones whole groups of
    columns (act-order: all the scales and their columns' g_idx); dequantized, each rank's
    weights are its slice of the one-rank model's."""
    folder, _ = _packed(tmp_path, "qwen2", packing)
    _assert_rank_slices(folder)


def _assert_rank_slices(folder: str, load_format: str = "auto") -> None:
    """Each of two ranks' dequantized weights is its slice of the one-rank model's."""
    full = dict(load_our_model(folder, load_format=load_format, quantization="none")
                .named_parameters())  # fmt: skip
    for rank in range(2):
        with building_rank(rank, 2):
            shard = load_our_model(folder, load_format=load_format, quantization="none")
        for name, param in shard.named_parameters():
            want = full[name]
            fused = {"qkv_proj": [128, 64, 64], "gate_up_proj": [256, 256]}
            parts = [v for k, v in fused.items() if f".{k}." in name]
            if parts:
                want = torch.cat([t.chunk(2)[rank] for t in want.split(parts[0])])
            elif param.shape != want.shape:
                dim = 0 if param.shape[-1] == want.shape[-1] else 1
                want = want.chunk(2, dim)[rank]
            assert torch.equal(param, want), f"rank {rank}: {name}"


# ---------------------------------------------------------------- dummy weights


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_dummy_weights_in_each_int_format(method, tmp_path):
    """load_format="dummy" with an int format the config does not state: the format's usual
    config (4-bit, groups of 128) and random int weights at its layout, kept int where the
    block kernel runs; dequantized, each group of a row takes at most 16 levels and the
    weights' spread is the config's initializer_range (0.02)."""
    folder = make_tiny_hf_model("qwen2", tmp_path, **TINY)
    args = EngineArgs(model=folder, load_format="dummy", quantization=method, device="cpu")
    stated = quant_config_dict(args.create_model_config(torch.device("cpu")).hf_config)
    assert stated == default_config(method)
    model = load_our_model(folder, load_format="dummy", quantization=method)
    down = model.model.layers[0].mlp.down_proj
    if BLOCKS:
        assert type(down.packed_weight).__name__ == "WNA16BlockWeight"
        weight = down.packed_weight(torch.eye(256)).t()  # [N, K]: the dense copy's rows
    else:
        weight = down.weight
    assert weight.shape == (128, 256) and 0.01 < float(weight.std()) < 0.03
    assert max(len(group.unique()) for group in weight.reshape(-1, 128)) <= 16


def test_dummy_weights_of_a_folders_config_split_over_ranks(tmp_path):
    """A folder whose config.json states a GPTQ quantization_config, with dummy weights: its
    scheme (groups of 32), and the same model whatever the number of ranks."""
    folder = make_tiny_hf_model("qwen2", tmp_path, **TINY)
    _set_config(folder, **quantization_config(Packing("gptq", 4, 32, False)))
    model = load_our_model(folder, load_format="dummy")
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.scheme.group_size == 32
    _assert_rank_slices(folder, load_format="dummy")


def test_engine_runs_dummy_int4_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model("llama", tmp_path, **TINY)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model=folder, load_format="dummy", quantization="awq", max_model_len=64) as llm:
        assert llm.llm_engine.config.model_config.quantization == "awq"
        [out] = llm.generate([{"prompt_token_ids": [3, 17, 99]}], params)
    assert len(out.outputs[0].token_ids) == 6


def test_row_split_inside_a_group_is_a_clear_error(tmp_path):
    folder, _ = _packed(tmp_path, "llama", Packing("gptq", 4, 128))
    with building_rank(0, 2), pytest.raises(ValueError, match=(
        r"tensor parallel: 128 input columns split into 64 per rank, not a multiple of the "
        r"checkpoint's group_size 128")):  # fmt: skip
        load_our_model(folder)


def test_two_ranks_same_greedy_ids_as_one(tmp_path, monkeypatch):
    folder, _ = _packed(tmp_path, "llama", Packing("gptq", 4, 32, False))
    prompts = [{"prompt_token_ids": [3, 17 + i, 99, 250, 7]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = []
    for tp in (2, 1):
        if tp == 1:
            monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        with LLM(model=folder, dtype="float32", max_model_len=128, tensor_parallel_size=tp,
                 kv_cache_memory_bytes=1 << 22) as llm:  # fmt: skip
            ids.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert ids[0] == ids[1]


# ---------------------------------------------------------------- configs as others write them


def _logits_match(folder: str, reference: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    fed, got = run_paged(load_our_model(folder), [[3, 17, 99, 250, 7]], num_decode_steps=2)[0]
    torch.testing.assert_close(got, hf_logits(hf, fed), rtol=1e-4, atol=1e-4)


def test_act_order_spellings_and_a_g_idx_the_config_denies(tmp_path):
    """compressed-tensors' `actorder: "dynamic"` is its alias of "group" (the g_idx is read);
    a GPTQ config saying desc_act false over a permuted g_idx is an error, not dropped."""
    actorder = Packing("compressed-tensors", 4, 32, False, True)
    folder, reference = _packed(tmp_path, "qwen2", actorder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "dynamic"
    json.dump(config, open(path, "w"))
    _logits_match(folder, reference)
    folder, _ = _packed(tmp_path / "gptq", "llama", Packing("gptq", 4, 32, False, True))
    _set_config(folder, desc_act=False)
    with pytest.raises(ValueError, match="states no act-order .* g_idx is not k // group_size"):
        load_our_model(folder)


def test_ignore_entries_as_transformers_and_compressed_tensors_read_them(tmp_path):
    """A module above the layer ("model.layers.1", transformers' prefix rule) and a "re:"
    pattern matched from the start (compressed-tensors' re.match) leave those layers float;
    one part of a fused layer left float alone is a clear error."""
    folder, reference = _packed(tmp_path, "llama", Packing("gptq", 4, 32, False))
    float_state = load_file(os.path.join(reference, "model.safetensors"))

    def floats(prefixes):
        def edit(state):
            for name in [n for n in state if n.startswith(prefixes)]:
                del state[name]
            for name in [n for n in float_state if n.startswith(prefixes)]:
                state[name] = float_state[name]

        return edit

    _write(folder, floats(("model.layers.1.",)))
    _set_config(folder, modules_to_not_convert=["model.layers.1"])
    _logits_match(folder, reference)
    folder, reference = _packed(tmp_path / "ct", "qwen3", Packing("compressed-tensors", 4, 32))
    float_state = load_file(os.path.join(reference, "model.safetensors"))
    _write(folder, floats(tuple(f"model.layers.{i}.mlp.down_proj." for i in range(2))))
    _set_config(folder, ignore=["lm_head", "re:.*down"])
    _logits_match(folder, reference)
    folder, reference = _packed(tmp_path / "awq", "llama", Packing("awq", 4, 32, False))
    float_state = load_file(os.path.join(reference, "model.safetensors"))
    _write(folder, floats(("model.layers.1.self_attn.k_proj.",)))
    _set_config(folder, modules_to_not_convert=["model.layers.1.self_attn.k_proj"])
    with pytest.raises(ValueError, match="not the other parts of the fused layer"):
        load_our_model(folder)
    # a layer the config leaves float but the file holds packed: the error names the tensor
    folder, _ = _packed(tmp_path / "ct2", "llama", Packing("compressed-tensors", 4, 32))
    _set_config(folder, ignore=["lm_head", "model.layers.1.mlp.down_proj"])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight"):
        load_our_model(folder)


def test_a_folder_named_with_glob_characters(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path / "run[1]", std=0.1, **TINY)
    assert load_our_model(folder) is not None


def test_deepseek_with_every_linear_quantized(tmp_path, monkeypatch):
    """GPTQ / AWQ / llm-compressor quantize every Linear of DeepSeek-V2, `kv_b_proj` too,
    which latent attention absorbs: dequantized at load, the dequantized model's logits."""
    import wna16_pack

    monkeypatch.setattr(
        wna16_pack, "PROJECTIONS", (*wna16_pack.PROJECTIONS, "kv_a_proj_with_mqa", "kv_b_proj")
    )
    latent = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_group=1,
                  topk_group=1)  # fmt: skip
    folder, reference = _packed(tmp_path, "deepseek_v2", Packing("gptq", 4, 32), **latent)
    assert "model.layers.0.self_attn.kv_b_proj.qweight" in load_file(
        os.path.join(folder, "model.safetensors")
    )
    _logits_match(folder, reference)
