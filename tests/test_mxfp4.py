"""MXFP4 experts (gpt-oss checkpoints' `quant_method: "mxfp4"`) on the CPU: a tiny random
gpt-oss whose expert weights the tests pack themselves (`tests/mxfp4_pack.py`, written from
the format, not from the loader), served from `*_blocks` / `*_scales` tensors and compared
with HF's model holding the dequantized weights the packing chose: greedy ids equal
(float32, CPU, one engine, batched and chunked) and every position's logits within 1e-4.
A malformed tensor is a ValueError naming it. (The CUDA path, experts kept as stored:
`test_fused_moe_gpt_oss.py`.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_utils import (
    hf_generate_greedy,
    hf_logits,
    hf_model,
    load_our_model,
    make_tiny_hf_model,
    run_paged,
)
from mxfp4_pack import pack_mxfp4
from safetensors.torch import load_file, save_file
from test_gpt_oss import GPT_OSS, _prompts

from pagellm import LLM, SamplingParams
from pagellm.quantization.mxfp4 import dequantize_mxfp4

PROJECTIONS = ("gate_up_proj", "down_proj")
NEW_TOKENS = 16


def write_mxfp4_folder(folder: str, out: Path) -> dict[str, torch.Tensor]:
    """`folder`'s checkpoint with its experts' weights as MXFP4, rows (outputs) first as
    OpenAI's checkpoints store them; returns the encoded weights in HF's layout by name."""
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (Path(folder) / name).exists():
            shutil.copy(Path(folder) / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (out / "config.json").write_text(json.dumps(config))
    tensors, encoded = load_file(str(Path(folder) / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
        rows_first = tensors.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        blocks, scales, weight = pack_mxfp4(rows_first)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        encoded[name] = weight.transpose(1, 2).contiguous()  # HF's [E, in, out]
    save_file(tensors, str(out / "model.safetensors"))
    return encoded


def mxfp4_and_hf(root: Path, **config) -> tuple[str, torch.nn.Module]:
    """A tiny gpt-oss (`config` over GPT_OSS) written as MXFP4 under root / "mxfp4", and HF's
    float32 model on the weights that folder encodes."""
    folder = make_tiny_hf_model("gpt_oss", root, **{**GPT_OSS, **config})
    encoded = write_mxfp4_folder(folder, root / "mxfp4")
    hf = hf_model(folder)
    with torch.no_grad():
        for name, weight in encoded.items():
            hf.get_parameter(name).copy_(weight)
    return str(root / "mxfp4"), hf


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 folder, HF model with the encoded weights, one engine on the folder)."""
    folder, hf = mxfp4_and_hf(tmp_path_factory.mktemp("mxfp4"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=32)
    yield Path(folder), hf, llm
    llm.shutdown()


def test_packing_is_lossy_here():
    """The packing moves the weights (so serving the float ones would fail the tests)."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    _, _, encoded = pack_mxfp4(w)
    assert 0.01 < (encoded - w).abs().max() < 1.0


def test_dequantize_matches_the_packing():
    w = torch.randn(3, 8, 96, generator=torch.Generator().manual_seed(1)) * 5
    blocks, scales, encoded = pack_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), encoded)


def test_greedy_equals_hf_on_the_dequantized_weights(mxfp4):
    _, hf, llm = mxfp4
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_generate_greedy(hf, [prompt], NEW_TOKENS)[0]


def test_logits_equal_hf_on_the_dequantized_weights(mxfp4):
    folder, hf, _ = mxfp4
    ours = load_our_model(str(folder))
    for tokens, logits in run_paged(ours, _prompts()[:2], num_decode_steps=3, chunk_size=8):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-5)


def _broken(folder: Path, tmp_path: Path, edit) -> str:
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def test_malformed_scales_name_the_tensor(mxfp4, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def cut(tensors):
        tensors[name] = tensors[name][..., :1].contiguous()

    with pytest.raises(ValueError, match=f"MXFP4 tensor {name}: shape"):
        load_our_model(_broken(mxfp4[0], tmp_path, cut))


def test_blocks_without_scales_name_the_tensor(mxfp4, tmp_path):
    def drop(tensors):
        del tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]

    stem = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=f"MXFP4 tensor {stem}: the checkpoint has only"):
        load_our_model(_broken(mxfp4[0], tmp_path, drop))


def test_blocks_of_the_wrong_dtype_name_the_tensor(mxfp4, tmp_path):
    name = "model.layers.2.mlp.experts.gate_up_proj_blocks"

    def widen(tensors):
        tensors[name] = tensors[name].to(torch.int16)

    with pytest.raises(ValueError, match=f"MXFP4 tensor {name}: expected uint8"):
        load_our_model(_broken(mxfp4[0], tmp_path, widen))


def test_quantization_name_mxfp4(mxfp4):
    """quantization="mxfp4" (vLLM's name) takes an MXFP4 checkpoint; elsewhere it is a
    ValueError saying what it needs."""
    from pagellm.quantization import resolve_quantization

    config = json.loads((mxfp4[0] / "config.json").read_text())
    checkpoint = type("C", (), config)()
    cpu = torch.device("cpu")
    assert resolve_quantization("mxfp4", checkpoint, "hf", cpu) == "mxfp4"
    assert resolve_quantization(None, checkpoint, "hf", cpu) == "mxfp4"
    del config["quantization_config"]
    with pytest.raises(ValueError, match="needs a MXFP4 checkpoint"):
        resolve_quantization("mxfp4", type("C", (), config)(), "hf", cpu)
