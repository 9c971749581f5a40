"""Model sources (local, Hub, shipped), HF and generation configs, tokenizers and weights
(HF safetensors / .bin, GGUF, dummy)."""

from pagellm.loader.generation_config import load_generation_config
from pagellm.loader.hf_config import load_hf_config
from pagellm.loader.model_loader import load_model
from pagellm.loader.source import ModelSource, resolve_model_source
from pagellm.loader.tokenizer import load_tokenizer

__all__ = [
    "ModelSource",
    "load_generation_config",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "resolve_model_source",
]
