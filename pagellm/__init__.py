"""pagellm: a readable LLM inference engine on vLLM's V1 architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.lora.request import LoRARequest
from pagellm.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.entrypoints.llm import LLM

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "LoRARequest",
]


def __getattr__(name: str) -> Any:
    # torch and transformers load only when the engine is used
    if name == "LLM":
        from pagellm.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from pagellm.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
