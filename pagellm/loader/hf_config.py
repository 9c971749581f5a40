"""The HF `PretrainedConfig` of a model source: read from config.json, or built from GGUF
metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.source import ModelSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    # transformers is imported here, not at module level: the EngineCore process gets its
    # config from the caller and never imports it (several seconds on some machines)
    from transformers import AutoConfig

    from pagellm.loader.gguf_loader import config_from_gguf

    if source.path.endswith(".gguf"):
        return config_from_gguf(read_gguf(source.path))
    return AutoConfig.from_pretrained(source.path)
