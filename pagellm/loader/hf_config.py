"""The HF `PretrainedConfig` of a model source: read from config.json, or built from GGUF
metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

    return language_model_config(AutoConfig.from_pretrained(source.path))


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
