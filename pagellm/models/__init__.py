"""Decoder models on shared layers; `get_model_cls(architectures[0])` picks the class."""

from pagellm.models.registry import get_model_cls, supported_architectures

__all__ = ["get_model_cls", "supported_architectures"]
