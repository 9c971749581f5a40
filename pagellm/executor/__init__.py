"""Executors: how the EngineCore runs a step on the model's ranks (see `abstract.py`)."""

from pagellm.executor.abstract import Executor

__all__ = ["Executor"]
