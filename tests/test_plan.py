"""`pagellm plan`: its predictions against a real engine (CPU), against transformers' own
parameter counts of the shipped configs, against the KV cache manager's block accounting,
and its command line; `max_model_len="auto"` resolved by the engine as the planner says.

The GPU side (the profiled peak the planner estimates) is checked on a card by
benchmarks/plan_check.py.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
from model_utils import make_tiny_hf_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.cli import main
from pagellm.config import DEFAULT_CPU_KV_CACHE_BYTES
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import fit_max_model_len
from pagellm.engine.plan import plan_memory
from pagellm.loader import resolve_model_source
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.source import shipped_config_dir

GPU_GIB = 80.0  # plans for a card this machine need not have
# the tiny model's KV block: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes x 16 tokens
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 4 * 16
TINY_KV_BYTES = 20 * TINY_BLOCK_BYTES + 100  # 20 blocks (and change): 19 x 16 = 304 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def tiny_args(tiny) -> dict:
    return dict(
        model=tiny, dtype="float32", device="cpu", kv_cache_memory_bytes=TINY_KV_BYTES,
        max_model_len="auto",
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_args):
    llm = LLM(**tiny_args)
    yield llm.llm_engine
    llm.shutdown()


# ---- against a real engine on the CPU ---------------------------------------------------


def test_cpu_plan_is_what_the_engine_allocates(engine, tiny_args):
    plan = plan_memory(EngineArgs(**tiny_args))
    (rank,) = engine.call_utility("collective_rpc", "describe", [])
    assert rank["kv_block_bytes"] == plan.kv_block_bytes == TINY_BLOCK_BYTES
    assert engine.call_utility("get_num_kv_blocks") == plan.num_blocks == 20
    assert rank["kv_cache_bytes"] == plan.num_blocks * plan.kv_block_bytes
    assert rank["weight_bytes"] == plan.weight_bytes
    assert plan.kv_tokens == 19 * 16


def test_max_model_len_auto_is_the_plans(engine, tiny_args):
    plan = plan_memory(EngineArgs(**tiny_args))
    assert plan.max_model_len_auto == 304 < plan.max_position_embeddings == 512
    assert engine.config.model_config.max_model_len == 304  # the caller got the core's
    assert not engine.config.model_config.max_model_len_auto
    with pytest.raises(ValueError, match="maximum model length of 304"):
        engine.add_request("long", {"prompt_token_ids": [5] * 305}, SamplingParams())
    out = _generate(engine, [5] * 300, SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def _generate(engine, prompt_ids: list[int], params: SamplingParams):
    engine.add_request("r", {"prompt_token_ids": prompt_ids}, params)
    while True:
        for out in engine.step():
            if out.finished:
                return out


def test_max_model_len_auto_is_logged(tiny_args, caplog):
    config = EngineArgs(**tiny_args).create_engine_config()
    assert config.model_config.max_model_len_auto and config.model_config.max_model_len == 512
    with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
        fitted = fit_max_model_len(config, 20, None)
    assert fitted.model_config.max_model_len == fitted.scheduler_config.max_model_len == 304
    assert "max_model_len auto: 304 tokens (the KV cache holds 304 tokens)" in caplog.text
    fixed = EngineArgs(**{**tiny_args, "max_model_len": 256}).create_engine_config()
    assert fit_max_model_len(fixed, 20, None) is fixed  # a given length stays as it is


def test_cpu_default_kv_budget(tiny):
    plan = plan_memory(EngineArgs(model=tiny, dtype="float32", device="cpu"))
    assert plan.kv_budget_bytes == DEFAULT_CPU_KV_CACHE_BYTES
    assert plan.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // TINY_BLOCK_BYTES
    assert plan.reserved == {} and plan.fits


def test_checkpoint_bytes_from_safetensors_headers(tiny):
    plan = plan_memory(EngineArgs(model=tiny, dtype="float32", device="cpu"))
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    assert plan.checkpoint_bytes == {"F32": sum(t.nbytes for t in tensors.values())}


# ---- the shipped configs against transformers -------------------------------------------

# families whose norms the loader keeps in float32 (Gemma's (1 + w) norms)
FLOAT32_NORMS = {"gemma-2-9b"}


def _hf_model(name: str):
    config = AutoConfig.from_pretrained(shipped_config_dir(name))
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def _hf_bytes(name: str, model) -> int:
    """Parameters x bf16 bytes (a tied parameter once), float32 norms where kept so."""
    total = 0
    for pname, p in model.named_parameters():
        wide = name in FLOAT32_NORMS and "norm" in pname
        total += p.numel() * (4 if wide else 2)
    return total


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b", "gemma-2-9b", "qwen3-30b-a3b"])
def test_shipped_weights_and_kv_match_transformers(name):
    config, model = _hf_model(name)
    plan = plan_memory(EngineArgs(model=name), GPU_GIB)
    assert plan.weight_bytes == _hf_bytes(name, model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 2
    assert plan.kv_bytes_per_token == per_token
    assert plan.fits and plan.num_blocks * plan.kv_block_bytes <= plan.kv_budget_bytes


def test_fp8_kv_cache_halves_kv_bytes():
    bf16 = plan_memory(EngineArgs(model="llama-3.1-8b"), GPU_GIB)
    fp8 = plan_memory(EngineArgs(model="llama-3.1-8b", kv_cache_dtype="fp8"), GPU_GIB)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.kv_cache_dtype == "float8_e4m3fn" and fp8.weight_bytes == bf16.weight_bytes
    assert abs(fp8.num_blocks / bf16.num_blocks - 2) < 0.01


def test_tp2_halves_what_each_rank_holds():
    _, model = _hf_model("llama-3.1-8b")
    one = plan_memory(EngineArgs(model="llama-3.1-8b"), GPU_GIB)
    two = plan_memory(EngineArgs(model="llama-3.1-8b", tensor_parallel_size=2), GPU_GIB)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token and two.num_kv_heads == 4
    # every matrix (embedding and LM head by vocabulary rows) split; norms on every rank
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1) * 2
    assert two.weight_bytes == (_hf_bytes("llama-3.1-8b", model) - norms) // 2 + norms
    assert "-tp 2" in two.chosen.command


def test_fp8_weights_as_the_loader_quantizes_them():
    _, model = _hf_model("llama-3.1-8b")
    expected = 0
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, torch.nn.Linear) and name != "lm_head":  # Llama's have no bias
            expected += own + module.out_features * 4  # fp8 values, a float32 scale a row
        else:
            expected += own * 2
    plan = plan_memory(EngineArgs(model="llama-3.1-8b", quantization="fp8"), GPU_GIB)
    assert plan.weight_bytes == expected and plan.quantization == "fp8"


def test_gguf_weights_dequantized_on_cuda(embedded_gguf):
    path = resolve_model_source(None, "auto", None).path
    tensors = read_gguf(path).tensors.values()
    plan = plan_memory(EngineArgs(dtype="bfloat16"), GPU_GIB)  # the embedded GGUF
    assert plan.weight_bytes == sum(math.prod(t.shape) for t in tensors) * 2
    stored = sum(plan.checkpoint_bytes.values())
    assert stored == sum(t.data.nbytes for t in tensors)
    assert 0.9 * os.path.getsize(path) < stored < os.path.getsize(path)


# ---- sliding windows ----------------------------------------------------------------------


def test_partly_windowed_layers_hold_every_token():
    plan = plan_memory(EngineArgs(model="gemma-2-9b"), GPU_GIB)
    assert plan.windowed_layers == 21 and plan.sliding_window is None
    row = next(r for r in plan.rows if r.max_model_len == 8192)
    assert row.max_num_seqs == min(256, (plan.num_blocks - 1) // (8192 // 16))


def test_windowed_rows_match_the_kv_cache_manager(tmp_path):
    """The plan's count of full-length requests of an every-layer-windowed model fit in the
    real KVCacheManager, grown 16 tokens a step; one more does not."""
    folder = make_tiny_hf_model("mistral", tmp_path, sliding_window=64)
    args = EngineArgs(
        model=folder, dtype="float32", device="cpu", num_gpu_blocks_override=23,
        max_num_batched_tokens=16, max_num_seqs=64,
    )  # fmt: skip
    plan = plan_memory(args)
    assert plan.sliding_window == 64 and plan.max_model_len_auto == 512
    (row,) = [r for r in plan.rows if r.max_model_len == 512]
    manager = KVCacheManager(16, 23, 512, enable_caching=False, sliding_window=64)
    fitted = [_grow(manager, Request(str(i), [1] * 512, SamplingParams())) for i in range(6)]
    assert row.max_num_seqs == 4 == fitted.index(False)


def _grow(manager: KVCacheManager, request: Request) -> bool:
    """Compute the request 16 tokens a step, as chunked prefill does; False if blocks ran out."""
    while request.num_computed_tokens < request.num_tokens:
        if manager.allocate_slots(request, 16) is None:
            return False
        request.num_computed_tokens += 16
    return True


# ---- the command line ---------------------------------------------------------------------


def test_cli_prints_the_table_and_the_flags(capsys):
    code = main(["plan", "qwen3-0.6b", "--gpu-memory", "80", "--kv-cache-dtype", "fp8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "max_model_len  requests at once" in out
    for length in (2048, 4096, 32768, 40960):
        assert f"\n  {length:>13}  " in out
    assert "pagellm serve qwen3-0.6b --max-model-len 40960 --max-num-seqs " in out
    assert "--load-format dummy --kv-cache-dtype fp8" in out


def test_cli_json_for_a_chosen_length(capsys):
    argv = ["plan", "llama-3.1-8b", "--gpu-memory", "80", "--json", "--max-model-len", "32768"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["chosen"]["max_model_len"] == 32768
    count = min(256, (plan["num_blocks"] - 1) // (32768 // 16))
    assert plan["chosen"]["max_num_seqs"] == count
    assert f"--max-model-len 32768 --max-num-seqs {count}" in plan["chosen"]["command"]
    lengths = [r["max_model_len"] for r in plan["rows"]]
    assert lengths == sorted(lengths) and lengths[-1] == 131072


def test_cli_says_what_does_not_fit(capsys):
    assert main(["plan", "llama-3.1-70b", "--gpu-memory", "80"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: the model alone needs" in out and "GiB more than" in out
    assert "-tp 2:" in out and "--quantization fp8:" in out


def test_a_set_kv_cache_size_over_the_card():
    args = EngineArgs(model="llama-3.1-8b", kv_cache_memory_bytes=20 << 30)
    plan = plan_memory(args, 24.0)
    assert plan.num_blocks == (20 << 30) // plan.kv_block_bytes and plan.chosen is None
    (problem,) = plan.problems
    assert f"a KV cache of {plan.num_blocks} blocks need" in problem
    assert plan_memory(args, 48.0).fits


def test_cli_max_model_len_over_the_cache(tiny, capsys):
    argv = ["plan", tiny, "--device", "cpu", "--dtype", "float32"]
    argv += ["--kv-cache-memory-bytes", str(TINY_KV_BYTES), "--max-model-len", "512"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "--max-model-len 512 does not fit one request: the KV cache holds 304 tokens" in out
    assert f"--kv-cache-memory-bytes {33 * TINY_BLOCK_BYTES}" in out


def test_cli_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["plan", "nobody-here/no-such-model", "--gpu-memory", "80"]
    assert main(argv + ["--download-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "reads only config.json" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: its size is the default")
def test_cli_cuda_without_a_gpu_asks_for_its_memory(capsys):
    assert main(["plan", "qwen3-0.6b", "--device", "cuda"]) == 2
    assert "--gpu-memory GiB" in capsys.readouterr().err
