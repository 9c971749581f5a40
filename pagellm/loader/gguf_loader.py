"""GGUF files as HF configs and HF-named float32 weights.

llama.cpp's converter reorders the rows of each Q and K head of llama-architecture models
from HF's rotate-half layout (first half | second half of the rotary dimensions) to an
interleaved one (pairs); `_unpermute` restores HF's order. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Container, Iterator

import torch

from pagellm.config import HFConfigView
from pagellm.loader.gguf_file import GGUFFile, GGUFTensor
from pagellm.quantization.gguf_dequant import dequantize

# GGUF general.architecture -> (HF model_type, HF architecture name)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# what transformers' config class of each adds to the file's values (its defaults, as its
# `to_dict()` writes them); tests/test_loader.py checks them against transformers
_COMMON_DEFAULTS = {"hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
                    "attention_dropout": 0.0}  # fmt: skip
_DEFAULTS = {
    "llama": {"pretraining_tp": 1, "attention_bias": False, "mlp_bias": False},
    "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    "qwen3": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": 28},
}  # fmt: skip
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_NOT_WEIGHTS = ("rope_freqs.weight",)  # llama3 rope factors: become config.rope_scaling


def config_from_gguf(gguf: GGUFFile) -> HFConfigView:
    """The HF config of a GGUF file, as transformers' config class of its architecture would
    hold it, built without importing transformers (its Llama config module alone takes
    1.5-2.5 s to import, most of a CPU start-up's budget)."""
    arch = gguf.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    model_type, hf_arch = _ARCHITECTURES[arch]
    values = _config_kwargs(gguf, arch)
    theta, scaling = values.pop("rope_theta"), values.pop("rope_scaling")
    values["rope_parameters"] = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    if arch != "llama":  # Qwen configs list each layer's attention kind
        values["layer_types"] = ["full_attention"] * values["num_hidden_layers"]
    return HFConfigView(
        architectures=[hf_arch], model_type=model_type, dtype=None,
        **_COMMON_DEFAULTS, **_DEFAULTS[arch], **values,
    )  # fmt: skip


def _config_kwargs(gguf: GGUFFile, arch: str) -> dict:
    def meta(key: str, default=None):
        return gguf.get(f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    theta = float(meta("rope.freq_base", 10000.0))
    vocab = meta("vocab_size") or len(gguf.get("tokenizer.ggml.tokens", ()))
    return dict(
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=meta("context_length", 2048),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf.get("tokenizer.ggml.padding_token_id"),
        rope_theta=theta,
        rope_scaling=_rope_scaling(gguf, arch, head_dim, theta),
    )


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int, theta: float) -> dict | None:
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf.get(f"{arch}.rope.scaling.factor"))}
    if kind not in ("none", None):
        raise NotImplementedError(f"{gguf.path}: rope scaling {kind!r} is not supported")
    if "rope_freqs.weight" in gguf.tensors:
        factors = dequantize(gguf.tensors["rope_freqs.weight"])
        return _llama3_scaling(factors, head_dim, theta, gguf.path)
    return None


def _llama3_scaling(factors: torch.Tensor, head_dim: int, theta: float, path: str) -> dict:
    """Llama 3.x files store per-frequency divisors; find the llama3 parameters behind them."""
    from pagellm.layers.rope import default_inv_freq, llama3_inv_freq

    base = default_inv_freq(head_dim, theta)
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if torch.allclose(base / llama3_inv_freq(base, scaling), factors, rtol=1e-3):
            return scaling
    raise NotImplementedError(f"{path}: rope_freqs do not match a llama3 rope scaling")


def gguf_weights(
    gguf: GGUFFile, raw_names: Container[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of the file, Q/K rows in HF order; the HF
    names in `raw_names` come as their GGUF blocks instead (uint8 [rows, bytes per row]:
    rows are whole blocks, so the Q/K row order is restored the same way)."""
    arch = gguf.get("general.architecture")
    heads = gguf.get(f"{arch}.attention.head_count")
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
    for name, tensor in gguf.tensors.items():
        if name in _NOT_WEIGHTS:
            continue
        name_hf = hf_name(name)
        weight = torch.from_numpy(tensor.data) if name_hf in raw_names else dequantize(tensor)
        if arch == "llama" and ".attn_q." in name:
            weight = _unpermute(weight, heads)
        elif arch == "llama" and ".attn_k." in name:
            weight = _unpermute(weight, kv_heads)
        yield name_hf, weight


def gguf_tensors(gguf: GGUFFile) -> dict[str, GGUFTensor]:
    """Every weight of the file by its HF name, not read (for `quantization="gguf"`: which
    layers stay in blocks)."""
    return {hf_name(n): t for n, t in gguf.tensors.items() if n not in _NOT_WEIGHTS}


def gguf_shapes(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, a `meta` tensor of the dequantized shape) for every weight: nothing is read."""
    for name, tensor in gguf.tensors.items():
        if name not in _NOT_WEIGHTS:
            yield hf_name(name), torch.empty(tensor.shape, device="meta")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # w: [n_head * head_dim, ...]; per head, rows (pair j, member i) -> (half i, index j)
    head_dim = w.shape[0] // n_head
    if head_dim % 2 or w.shape[0] != n_head * head_dim:
        raise ValueError(f"cannot unpermute {tuple(w.shape)} for {n_head} heads")
    rest = w.shape[1:]
    return w.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)
