"""The HF `PretrainedConfig` of a model source: read from config.json, or built from GGUF
metadata."""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any

from pagellm.config import HFConfigView, ModelSource
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.gguf_loader import config_from_gguf

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def load_hf_config(source: ModelSource) -> PretrainedConfig | HFConfigView:
    if source.path.endswith(".gguf"):
        return config_from_gguf(read_gguf(source.path))
    # transformers is imported here, not at module level: the EngineCore process gets its
    # config from the caller and never imports it (several seconds on some machines)
    from transformers import AutoConfig

    data = _config_json(source.path)
    if data.get("model_type") in _MODEL_TYPE_OF:  # its own config class: remote code
        fields = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
        return AutoConfig.for_model(_MODEL_TYPE_OF[data["model_type"]], **fields)
    return language_model_config(AutoConfig.from_pretrained(source.path))


# checkpoints whose config.json names a model type of their own (a config class in remote
# code) that is another's with extra fields: Xiaomi MiMo is Qwen2's, `num_nextn_predict_layers`
_MODEL_TYPE_OF = {"mimo": "qwen2"}


def _config_json(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """A multimodal checkpoint served as text (Gemma3ForConditionalGeneration): its text
    config, under the checkpoint's architecture name."""
    if (config.architectures or [""])[0] not in _TEXT_OF_MULTIMODAL:
        return config
    text = config.get_text_config()
    text.architectures = list(config.architectures)
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    return text


_TEXT_OF_MULTIMODAL = ("Gemma3ForConditionalGeneration",)


def with_hf_overrides(
    config: Any, overrides: dict[str, Any] | str | None, source: ModelSource
) -> Any:
    """vLLM's `hf_overrides`: these attributes of the HF config replaced (a dict, or its
    JSON text), e.g. {"architectures": ["Qwen3ForSequenceClassification"]}; classifier
    tokens as ids (`with_classifier_tokens`, with the source's tokenizer)."""
    if overrides is None:
        return config
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {overrides!r}")
    config = copy.deepcopy(config)
    for name, value in overrides.items():
        setattr(config, name, value)
    if getattr(config, "classifier_from_token", None):
        from pagellm.loader.tokenizer import load_tokenizer

        config = with_classifier_tokens(config, load_tokenizer(source))
    return config


def with_classifier_tokens(config: Any, tokenizer: Any) -> Any:
    """vLLM's `classifier_from_token` (a causal LM served as a classifier, Qwen3-Reranker):
    the tokens' ids, whose LM-head rows become the score head (`models/pooling.py`); one
    label (yes - no) with `is_original_qwen3_reranker`, else one a token."""
    tokens = getattr(config, "classifier_from_token", None)
    if not tokens:
        return config
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if None in ids or tokenizer.unk_token_id in ids:
        raise ValueError(f"classifier_from_token: {tokens} are not all tokens of the vocabulary")
    original = bool(getattr(config, "is_original_qwen3_reranker", False))
    if original and len(ids) != 2:
        raise ValueError("is_original_qwen3_reranker takes two tokens: [no, yes]")
    config.classifier_from_token_ids = ids
    config.id2label = {i: f"LABEL_{i}" for i in range(1 if original else len(ids))}
    return config
