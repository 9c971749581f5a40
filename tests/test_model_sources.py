"""What a model name resolves to (local folder, Hub id through a fake Hugging Face cache with
HF_HUB_OFFLINE=1, shipped configs only for dummy weights), the checkpoint layouts we read
(sharded safetensors with an index, PyTorch .bin), and clear errors for bad input, raised
before any weight is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from model_utils import fake_hub_snapshot, load_our_model, make_tiny_hf_model, save_tiny_tokenizer
from safetensors.torch import load_file, save_file
from timing import scaled
from transformers import AutoModelForCausalLM

from pagellm import LLM, EngineArgs
from pagellm.engine.arg_utils import _resolve_dtype
from pagellm.loader import model_loader, resolve_model_source
from pagellm.loader.hub import HubModelNotFound


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny Llama checkpoint (safetensors, no tokenizer)."""
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# ---------------------------------------------------------------- Hub ids and the cache


def test_hub_id_resolves_to_the_cached_snapshot(tiny, tmp_path, offline):
    cache = tmp_path / "hub"
    main = fake_hub_snapshot(cache, "org/tiny", tiny)
    v2 = fake_hub_snapshot(cache, "org/tiny", tiny, revision="v2", commit="b" * 40)
    source = resolve_model_source("org/tiny", download_dir=str(cache))
    assert (source.kind, source.path, source.name) == ("hf", main, "org/tiny")
    assert resolve_model_source("org/tiny", revision="v2", download_dir=str(cache)).path == v2
    config = EngineArgs(model="org/tiny", download_dir=str(cache)).create_engine_config()
    assert config.model_config.hf_config.hidden_size == 64
    assert config.model_config.served_model_name == "org/tiny"


def test_hf_home_is_the_default_cache(tiny, tmp_path):
    """HF_HOME and HF_HUB_OFFLINE as set when the process starts (huggingface_hub reads
    HF_HOME at import), in a fresh interpreter."""
    snapshot = fake_hub_snapshot(tmp_path / "home" / "hub", "org/tiny", tiny)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from pagellm.loader.source import resolve_model_source as r; print(r('org/tiny').path)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == snapshot


def test_download_asks_only_for_what_is_read(tmp_path, monkeypatch):
    """Online (the Hub stubbed): config and tokenizer files first, then the shards the index
    names (not the stray full copy, not the .bin); without an index the top-level
    safetensors; without safetensors the .bin."""
    import huggingface_hub

    from pagellm.loader.hub import META_PATTERNS, _top_level_weights, download_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    listing = ["config.json", "model.safetensors.index.json", *shards, "consolidated.safetensors"]
    listing += ["pytorch_model.bin", "original/consolidated.00.pth"]
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: listing)
    index = {"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    calls = []

    def snapshot_download(repo_id, *, revision, cache_dir, allow_patterns, local_files_only):
        calls.append((repo_id, revision, allow_patterns, local_files_only))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert download_model("org/m", "v1", None, with_weights=True) == str(tmp_path)
    assert calls == [("org/m", "v1", META_PATTERNS, False), ("org/m", "v1", shards, False)]
    top = ["config.json", "model.safetensors", "pytorch_model.bin", "sub/x.safetensors"]
    assert _top_level_weights(top) == ["model.safetensors"]
    assert _top_level_weights(["pytorch_model.bin", "training_args.bin"]) == ["pytorch_model.bin"]


def test_missing_hub_id_says_what_was_tried(tmp_path, offline):
    with pytest.raises(HubModelNotFound) as info:
        resolve_model_source("org/missing", download_dir=str(tmp_path / "hub"))
    message = str(info.value)
    assert "'org/missing' was not found" in message
    assert os.path.abspath("org/missing") in message  # not a local path
    assert str(tmp_path / "hub") in message  # not in this cache
    assert "HF_HUB_OFFLINE" in message  # and the Hub was not asked


def test_shipped_names_give_random_weights_only_when_asked(tmp_path, offline, monkeypatch):
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_model_source("qwen3-0.6b")
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError) as info:  # the LLM("Qwen/Qwen3-8B")
        LLM("Qwen/Qwen3-8B", download_dir=str(tmp_path / "hub"))
    assert "'Qwen/Qwen3-8B' was not found" in str(info.value)
    assert "load_format='dummy'" in str(info.value)
    assert resolve_model_source("Qwen/Qwen3-8B", "dummy").kind == "dummy"


def test_tokenizer_from_the_cache_and_missing_tokenizers(tiny, tmp_path, offline):
    cache = tmp_path / "hub"
    tok_folder = save_tiny_tokenizer(tmp_path / "tok")
    snapshot = fake_hub_snapshot(cache, "org/tok", tok_folder)
    source = resolve_model_source(tiny, tokenizer="org/tok", download_dir=str(cache))
    assert source.tokenizer == snapshot
    with pytest.raises(ValueError, match="tokenizer '/no/such/tok': no such file or folder"):
        resolve_model_source(tiny, tokenizer="/no/such/tok")
    with pytest.raises(ValueError, match=f"tokenizer folder {tiny} has none of tokenizer.json"):
        resolve_model_source(tiny, tokenizer=tiny)
    with pytest.raises(ValueError, match="'org/notok' was not found"):
        resolve_model_source(tiny, tokenizer="org/notok", download_dir=str(cache))


# ---------------------------------------------------------------- checkpoint layouts


def test_sharded_checkpoint_reads_only_the_index_shards(tiny, tmp_path, capfd):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # a stray full copy (as Mistral repositories ship `consolidated.safetensors`): ignored
    save_file({"junk": torch.zeros(3)}, str(folder / "consolidated.safetensors"))
    ours = _params(load_our_model(str(folder)))
    assert "Loading checkpoint shards" in capfd.readouterr().err  # the progress bar
    for name, param in _params(load_our_model(tiny)).items():
        assert torch.equal(ours[name], param), name


def test_bin_checkpoint_only_without_safetensors(tiny, tmp_path):
    import shutil

    folder = tmp_path / "bin"  # transformers 5 no longer writes .bin: written as torch.save does
    folder.mkdir()
    shutil.copy(os.path.join(tiny, "config.json"), folder)
    torch.save(load_file(os.path.join(tiny, "model.safetensors")), folder / "pytorch_model.bin")
    ours = _params(load_our_model(str(folder)))
    for name, param in _params(load_our_model(tiny)).items():
        assert torch.equal(ours[name], param), name
    with pytest.raises(ValueError, match=r"has no weights \(\*\.safetensors files\)"):
        resolve_model_source(str(folder), "safetensors")


def test_dtype_auto_is_the_checkpoint_dtype_on_gpu():
    from types import SimpleNamespace

    from pagellm.utils import cpu_bf16_units

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # on the CPU the checkpoint's dtype does not count: bf16 where it has bf16 units (issue 17)
    on_cpu = torch.float32 if cpu_bf16_units() is None else torch.bfloat16
    for config_dtype, on_gpu in [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.bfloat16),  # a float32 checkpoint runs in bfloat16, as in vLLM
    ]:
        for key in ("dtype", "torch_dtype"):  # transformers 5 and 4 names
            config = SimpleNamespace(**{key: config_dtype})
            assert _resolve_dtype("auto", config, cuda) == on_gpu
            assert _resolve_dtype("auto", config, cpu) == on_cpu


# ---------------------------------------------------------------- bad input


@pytest.fixture
def copy_of(tiny, tmp_path):
    def make() -> str:
        import shutil

        return shutil.copytree(tiny, tmp_path / "copy")

    return make


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if a tensor's data is read: errors must come from the headers."""

    def refuse(files):
        raise AssertionError(f"weights were read from {files}")

    monkeypatch.setattr(model_loader, "hf_folder_weights", refuse)


def _rewrite(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_unsupported_architecture(copy_of):
    folder = copy_of()
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        EngineArgs(model=folder).create_engine_config()


def test_folder_without_weights(copy_of):
    folder = copy_of()
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match=f"{folder} has no weights"):
        EngineArgs(model=folder).create_engine_config()


def test_missing_tensor_is_named(copy_of, no_weights_read):
    folder = copy_of()
    _rewrite(folder, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError) as info:
        load_our_model(folder)
    assert f"{folder} has no weights for 1 parameter(s)" in str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in str(info.value)
    _rewrite(folder, lambda s: s.pop("model.layers.0.mlp.up_proj.weight"))  # a fused part
    with pytest.raises(ValueError) as info:
        load_our_model(folder)
    assert ("model.layers.0.mlp.gate_proj.weight / up_proj.weight (fused as gate_up_proj: one "
            "or more missing)") in str(info.value)  # fmt: skip


def test_extra_tensor_is_named(copy_of, no_weights_read):
    folder = copy_of()
    _rewrite(folder, lambda s: s.update({"model.layers.7.mlp.up_proj.weight": torch.ones(2, 2)}))
    with pytest.raises(ValueError) as info:
        load_our_model(folder)
    assert "model.safetensors: tensor 'model.layers.7.mlp.up_proj.weight'" in str(info.value)


def test_wrong_shape_is_named(copy_of, no_weights_read):
    folder = copy_of()
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(folder, lambda s: s.update({name: torch.ones(48, 64)}))
    with pytest.raises(ValueError) as info:
        load_our_model(folder)
    message = str(info.value)
    assert f"model.safetensors: tensor '{name}'" in message
    assert "expected (32, 64), got (48, 64)" in message
