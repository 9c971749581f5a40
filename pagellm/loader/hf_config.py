"""The HF `PretrainedConfig` of a model source: read from config.json, or built from GGUF
metadata."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.gguf_loader import config_from_gguf
from pagellm.loader.source import ModelSource


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    if source.path.endswith(".gguf"):
        return config_from_gguf(read_gguf(source.path))
    return AutoConfig.from_pretrained(source.path)
