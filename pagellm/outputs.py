"""RequestOutput and CompletionOutput: what LLM.generate() returns, with vLLM's fields; the
pooling outputs (`PoolingRequestOutput`, `EmbeddingRequestOutput`, ...) of LLM.embed / classify /
score."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob
SampleLogprobs = list[dict[int, Logprob]]
# per prompt token: None for the first (nothing precedes it), then as SampleLogprobs
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    # LLM.chat / chat_stream with tool_call_parser / reasoning_parser (the server's parsers):
    # `text` is then the reply's content; tool calls as the server returns them (dicts: id,
    # type "function", function name and JSON arguments), None where no tool parser ran
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding: draft tokens verified for this completion, and those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # prompt tokens served from the prefix cache at the request's first scheduling (n > 1: the
    # fewest any completion found, i.e. what was cached before the request came)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    lora_request: Any = None  # the LoRARequest it ran with (None: the base model)
    kv_transfer_params: dict | None = field(default=None)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={self.outputs!r}, finished={self.finished})"
        )


# ---- pooling models: LLM.encode / embed / classify / score (vLLM's shapes) ------------------


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [n]: an embedding, or a classifier's probabilities / logits


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput, or the task's own (EmbeddingOutput, ...)
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache (a decoder's LAST pooling)

    output_cls: ClassVar[Any] = None  # the task's output: EmbeddingOutput, ...

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> Any:
        """The pooled output of `base` as this task's (vLLM's `from_base`)."""
        return cls(base.request_id, cls.output_cls.from_base(base.outputs),
                   base.prompt_token_ids, base.finished, base.prompt,
                   base.num_cached_tokens)  # fmt: skip


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        data = output.data
        if data.numel() != 1:
            raise ValueError(f"a score is one value; the model gave {data.numel()}")
        return cls(float(data.reshape(-1)[0]))


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput
    output_cls: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput
    output_cls: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
    output_cls: ClassVar[Any] = ScoringOutput
