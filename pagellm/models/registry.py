"""Model classes by HF architecture name (`config.architectures[0]`), imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module under pagellm.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "MiMoForCausalLM": ("mimo", "MiMoForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    # speculative decoding's heads, drafting for a target (speculative_config method eagle3,
    # mtp: a MiMo checkpoint's own MTP layers, built under this name by `mtp_head_config`)
    "LlamaForCausalLMEagle3": ("eagle3", "Eagle3LlamaForCausalLM"),
    "MiMoMTPModel": ("mimo", "MiMoMTPHead"),
}
# pooling checkpoints of a decoder family -> its causal LM's architecture (models/pooling.py):
# a bare decoder (AutoModel's) embeds, a *ForSequenceClassification classifies
_POOLING_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
# encoders (models/bert.py): pooling only, bidirectional, no KV cache, never chunked
_ENCODERS = {
    "BertModel": "BertEmbeddingModel",
    "BertForSequenceClassification": "BertForSequenceClassification",
    "XLMRobertaModel": "XLMRobertaEmbeddingModel",
    "XLMRobertaForSequenceClassification": "XLMRobertaForSequenceClassification",
    # RoBERTa: XLM-R's layout and names (positions from pad_token_id + 1, the same head)
    "RobertaModel": "XLMRobertaEmbeddingModel",
    "RobertaForSequenceClassification": "XLMRobertaForSequenceClassification",
    "ModernBertModel": "ModernBertEmbeddingModel",
    "ModernBertForSequenceClassification": "ModernBertForSequenceClassification",
}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_POOLING_MODELS, *_ENCODERS])


def is_pooling_architecture(architecture: str) -> bool:
    """A checkpoint without an LM head (an embedding model or a classifier): runner pooling."""
    return architecture in _POOLING_MODELS or architecture in _ENCODERS


def is_encoder_architecture(architecture: str) -> bool:
    """An encoder: attends both ways, keeps no KV cache, runs each prompt in one step."""
    return architecture in _ENCODERS


def check_architecture(architecture: str) -> None:
    """A ValueError naming `architecture` and the supported ones (nothing is imported)."""
    if not (architecture in _MODELS or is_pooling_architecture(architecture)):
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )


def get_model_cls(architecture: str, runner: str = "generate") -> type[nn.Module]:
    """The class serving `architecture`; with runner "pooling" (or a pooling checkpoint) its
    family's decoder without the LM head (`models/pooling.py`)."""
    check_architecture(architecture)
    if architecture in _ENCODERS:
        module = "modernbert" if architecture.startswith("ModernBert") else "bert"
        return getattr(importlib.import_module(f"pagellm.models.{module}"), _ENCODERS[architecture])
    causal = _POOLING_MODELS.get(architecture, architecture)
    module_name, cls_name = _MODELS[causal]
    cls = getattr(importlib.import_module(f"pagellm.models.{module_name}"), cls_name)
    if runner != "pooling" and causal == architecture:
        return cls
    from pagellm.models.pooling import as_pooling_model

    return as_pooling_model(cls, classify=architecture.endswith("ForSequenceClassification"))


def kv_sliding_window(architecture: str, hf_config: Any) -> int | None:
    """The largest sliding window if every attention layer has one, else None: beyond it no
    layer reads a request's keys, so the scheduler may free those blocks. Known from the
    config (the family's `sliding_windows`), where the scheduler is built."""
    windows = list(get_model_cls(architecture).sliding_windows(hf_config))
    return None if not windows or None in windows else max(windows)
