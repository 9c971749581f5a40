"""A pooling model's `PoolerConfig`, read from its folder as vLLM reads it.

sentence-transformers stores the pipeline in `modules.json`: a `Pooling` module (its folder's
`config.json` names the mode: `pooling_mode_lasttoken`, `pooling_mode_mean_tokens`,
`pooling_mode_cls_token`) and, for unit vectors, a `Normalize` module; its
`config_sentence_transformers.json` the default prompt, `truncate_dim` and (6.x) a
CrossEncoder's `activation_fn`, applied as sentence-transformers applies them. Matryoshka support is
the HF config's `is_matryoshka` / `matryoshka_dimensions`. Without these files a decoder
embeds with its last token, normalized (vLLM's default); a `*ForSequenceClassification`
checkpoint classifies with the last token, an encoder's with its CLS.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from pagellm.config import (
    CacheConfig,
    ModelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    architecture_of,
)
from pagellm.models.pooling import num_labels
from pagellm.models.registry import is_encoder_architecture, is_pooling_architecture

RUNNERS = ("auto", "generate", "pooling")
# a module's "type" ends with its class: sentence_transformers.models.Pooling (up to 5.x),
# sentence_transformers.sentence_transformer.modules.pooling.Pooling (6.x)
_POOLING, _NORMALIZE, _DENSE = "Pooling", "Normalize", "Dense"
_SERVED_MODULES = ("Transformer", _POOLING, _DENSE, _NORMALIZE)  # any other is refused
# a Dense module's activation_function -> the pooler's
_DENSE_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu",
                      "Sigmoid": "sigmoid", "GELU": "gelu", "SiLU": "silu"}  # fmt: skip
# a CrossEncoder's activation_fn (config.sentence_transformers, or <4.0's key) -> ours
_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax"}
_MODES = {  # the ST Pooling mode -> vLLM's pooling type
    "lasttoken": "LAST",
    "mean": "MEAN",
    "cls": "CLS",
}
# HF's problem_type -> classify()'s activation (vLLM's get_classification_act_fn)
_PROBLEM_TYPES = {"regression": "identity", "multi_label_classification": "sigmoid"}
# up to 5.x each mode is a bool key: pooling_mode_<mode> (mean as mean_tokens, cls as cls_token)
_LEGACY_MODES = {"mean_tokens": "mean", "cls_token": "cls"}


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def resolve_runner(runner: str, folder: str | None, hf_config: Any) -> str:
    """ "generate" or "pooling": `runner`, or for "auto" what the checkpoint is (a classifier,
    an LM-head-less model, or sentence-transformers files: pooling)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    arch = architecture_of(hf_config)
    if runner == "generate" and is_pooling_architecture(arch):
        raise ValueError(f"{arch} has no LM head: it is served with runner='pooling'")
    if runner != "auto":
        return runner
    if is_pooling_architecture(arch):
        return "pooling"
    return "pooling" if _st_modules(folder) else "generate"


def load_pooler_config(folder: str | None, hf_config: Any) -> PoolerConfig:
    arch = architecture_of(hf_config)
    modules = _st_modules(folder)
    unserved = [str(m.get("type")) for m in modules if _kind(m) not in _SERVED_MODULES]
    if unserved:
        raise ValueError(
            f"{folder}/modules.json: modules {unserved}; pagellm serves Transformer, Pooling, "
            "Dense and Normalize only"
        )
    st = _st_transformer_config(folder) if modules else {}
    model = _st_model_config(folder) if modules else {}
    pooling = next((m for m in modules if _kind(m) == _POOLING), None)
    encoder = is_encoder_architecture(arch)
    default_type = "CLS" if encoder else "LAST"  # vLLM's defaults
    if getattr(hf_config, "classifier_pooling", None) in ("cls", "mean"):  # ModernBERT's
        default_type = hf_config.classifier_pooling.upper()
    if is_classifier(arch):
        return PoolerConfig(task="classify", pooling_type=default_type, normalize=False,
                            num_labels=num_labels(hf_config), encoder=encoder,
                            activation=_cross_encoder_activation(hf_config, model),
                            classify_activation=_PROBLEM_TYPES.get(
                                getattr(hf_config, "problem_type", None)))  # fmt: skip
    pooling_type, include_prompt = default_type, True
    if pooling is not None:
        path = os.path.join(folder, pooling.get("path", ""), "config.json")
        pooling_type, include_prompt = _pooling_mode(path)
    prompt = _default_prompt(model)
    if prompt and not include_prompt and pooling_type != "LAST":
        raise ValueError(
            f"{folder}: the default prompt {prompt!r} is left out of the pooling "
            f"(include_prompt: false), which pagellm does not do for {pooling_type} pooling"
        )
    dense = _dense_modules(folder, modules)
    truncate_dim = model.get("truncate_dim")
    if truncate_dim is not None and (not isinstance(truncate_dim, int) or truncate_dim < 1):
        raise ValueError(f"{folder}/config_sentence_transformers.json: truncate_dim "
                         f"{truncate_dim!r} is not a positive integer")  # fmt: skip
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        task="embed",
        pooling_type=pooling_type,
        normalize=any(_kind(m) == _NORMALIZE for m in modules) if modules else True,
        matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=list(dims) if dims else None,
        encoder=encoder,
        max_seq_length=st.get("max_seq_length"),
        lowercase=bool(st.get("do_lower_case", False)),
        default_prompt=prompt,
        truncate_dim=truncate_dim,
        dense=tuple((path, act) for path, act, _ in dense),
        embedding_size=dense[-1][2] if dense else None,
    )


def pooling_configs(
    model_config: ModelConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    spec: SpeculativeConfig | None,
) -> tuple[CacheConfig, SchedulerConfig]:
    """A pooling model's cache and scheduling: the prefix cache only for a decoder's LAST
    pooling (MEAN and CLS pool every prompt token's state, which a cached prefix never
    computes; an encoder caches nothing); an encoder's prompts never chunked, so its token
    budget must hold a whole prompt; no drafts."""
    if spec is not None:
        raise ValueError("speculative_config: a pooling model (runner='pooling') samples nothing")
    pooler = model_config.pooler_config
    if pooler.encoder or pooler.pooling_type != "LAST":
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if not pooler.encoder:
        return cache, scheduler
    budget, max_len = scheduler.max_num_batched_tokens, model_config.max_model_len
    if budget < max_len:
        raise ValueError(
            f"an encoder runs each prompt in one step: max_num_batched_tokens ({budget}) must "
            f"be at least max_model_len ({max_len}); raise it or lower max_model_len"
        )
    return cache, dataclasses.replace(scheduler, enable_chunked_prefill=False)


def _st_modules(folder: str | None) -> list[dict[str, Any]]:
    """modules.json's entries; [] without one (or without a folder: GGUF, dummy weights)."""
    path = os.path.join(folder, "modules.json") if folder and os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        return []
    with open(path) as f:
        modules = json.load(f)
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of sentence-transformers modules")
    return [m for m in modules if isinstance(m, dict)]


def _st_transformer_config(folder: str) -> dict[str, Any]:
    """sentence_bert_config.json's max_seq_length and do_lower_case (5.x writes both there;
    6.x keeps the length as the tokenizer's model_max_length, which it truncates to)."""
    config: dict[str, Any] = {}
    path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    if config.get("max_seq_length") is None:
        tok = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tok):
            with open(tok) as f:
                length = json.load(f).get("model_max_length")
            if isinstance(length, int) and length < 1 << 30:  # HF's "no limit" is ~1e30
                config["max_seq_length"] = length
    return config


def _dense_modules(folder: str, modules: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The Dense modules after Pooling, in order: (folder, activation, out_features)."""
    kinds = [_kind(m) for m in modules]
    out = []
    for i, module in enumerate(modules):
        if kinds[i] != _DENSE:
            continue
        path = os.path.join(folder, module.get("path", ""))
        if _POOLING not in kinds[:i] or _NORMALIZE in kinds[:i]:
            raise ValueError(f"{path}: a Dense module is served between Pooling and Normalize "
                             "only (on the sentence embedding)")  # fmt: skip
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{path}: modules.json names a Dense module without its config")
        with open(config_path) as f:
            config = json.load(f)
        name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
        activation = _DENSE_ACTIVATIONS.get(name.rpartition(".")[2])
        if activation is None:
            raise ValueError(f"{config_path}: activation_function {name!r} is not served "
                             f"({', '.join(_DENSE_ACTIVATIONS)})")  # fmt: skip
        out.append((path, activation, int(config["out_features"])))
    return out


def _st_model_config(folder: str) -> dict[str, Any]:
    """config_sentence_transformers.json (prompts, default_prompt_name, truncate_dim; a
    6.x CrossEncoder's activation_fn), or {}."""
    path = os.path.join(folder, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}


def _default_prompt(model: dict[str, Any]) -> str:
    """The text of the model's default prompt (default_prompt_name's), "" without one."""
    name = model.get("default_prompt_name")
    if not name:
        return ""
    prompts = model.get("prompts") or {}
    if name not in prompts:
        raise ValueError(f"config_sentence_transformers.json: default_prompt_name {name!r} is "
                         f"not among its prompts {sorted(prompts)}")  # fmt: skip
    return str(prompts[name])


def _cross_encoder_activation(hf_config: Any, model: dict[str, Any]) -> str | None:
    """The activation a cross-encoder's files name: config_sentence_transformers.json (6.x),
    else config.json's sentence_transformers (4.x, 5.x) or <4.0's key."""
    st = getattr(hf_config, "sentence_transformers", None) or {}
    name = (
        model.get("activation_fn")
        or st.get("activation_fn")
        or getattr(hf_config, "sbert_ce_default_activation_function", None)
    )
    if not name:
        return None
    kind = _ACTIVATIONS.get(str(name).rpartition(".")[2])
    if kind is None:
        raise ValueError(f"the config's cross-encoder activation {name!r} is not served")
    return kind


def _kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rpartition(".")[2]


def _pooling_mode(path: str) -> tuple[str, bool]:
    """The Pooling module's mode (as vLLM's pooling type) and its include_prompt."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: modules.json names a Pooling module without its config")
    with open(path) as f:
        config = json.load(f)
    modes = config.get("pooling_mode")
    if modes is None:  # sentence-transformers up to 5.x
        modes = [
            _LEGACY_MODES.get(key[len("pooling_mode_") :], key[len("pooling_mode_") :])
            for key, value in config.items()
            if key.startswith("pooling_mode_") and value
        ]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(
            f"{path}: pooling mode {modes or 'none'}; pagellm pools with exactly one of "
            f"{', '.join(_MODES)}"
        )
    return _MODES[modes[0]], bool(config.get("include_prompt", True))
