"""The HF `PretrainedConfig` of a model source: read from config.json, or built from GGUF
metadata."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.source import ModelSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class HFConfigView(SimpleNamespace):
    """An HF config's attributes (its `to_dict()`) without transformers: the EngineCore
    process builds its model from this, so it never imports transformers (whose config
    classes pull in torchvision, torch._dynamo and sklearn on some machines: seconds); a
    GGUF file's config is built as one too (`config_from_gguf`)."""

    def to_json_string(self, use_diff: bool = False) -> str:
        """As the HF config's (the EngineCore process sends its config on to its workers)."""
        return json.dumps(vars(self))


def load_hf_config(source: ModelSource) -> PretrainedConfig | HFConfigView:
    from pagellm.loader.gguf_loader import config_from_gguf

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
