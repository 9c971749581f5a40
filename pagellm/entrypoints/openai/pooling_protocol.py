"""Pydantic models of the pooling endpoints' requests and answers: OpenAI's
`/v1/embeddings`, vLLM's `/score`, `/classify` and its Jina / Cohere style `/rerank`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, Field

from pagellm.entrypoints.openai.protocol import (
    IntIn,
    OpenAIModel,
    RequestModel,
    SamplingInt,
    Text,
)
from pagellm.entrypoints.openai.response_models import UsageInfo
from pagellm.sampling_params import INT32_MAX

MAX_INPUTS = 2048  # OpenAI's limit on an embeddings request's inputs
TokenIds = Annotated[list[IntIn(0, INT32_MAX)], Field(min_length=1)]  # no empty prompt
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
Inputs = Text | Texts | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
# keep the first n tokens of a text (the last n of token ids); -1: max_model_len
Truncate = Literal[-1] | SamplingInt("truncate_prompt_tokens") | None


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: Inputs | TokenIds  # a text, texts, token ids, or lists of token ids
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: IntIn(1, INT32_MAX) | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncate = None
    normalize: bool | None = None


class ClassificationRequest(RequestModel):
    model: str | None = None
    input: Inputs | TokenIds
    truncate_prompt_tokens: Truncate = None
    user: str | None = None


class ScoreRequest(RequestModel):
    """`text_1` against each of `text_2` (one to many, or N to N)."""

    model: str | None = None
    # vLLM's spellings too: queries / documents, queries / items, data_1 / data_2
    text_1: Text | Texts = Field(validation_alias=AliasChoices("text_1", "queries", "data_1"))
    text_2: Text | Texts = Field(
        validation_alias=AliasChoices("text_2", "documents", "items", "data_2")
    )
    truncate_prompt_tokens: Truncate = None


class RerankRequest(RequestModel):
    model: str | None = None
    query: Text
    documents: Texts
    top_n: IntIn(-INT32_MAX, INT32_MAX) | None = None  # None, 0 or below: every document (vLLM)
    return_documents: bool = True
    truncate_prompt_tokens: Truncate = None


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: float32 little-endian bytes


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ClassificationData(OpenAIModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIModel):  # vLLM's: both counts
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
