"""PoolingParams: what a pooling request (embed, classify, score) asks of its pooled state.

vLLM's names: `dimensions` (a Matryoshka model's embedding cut to its first n values, then
normalized again), `normalize` (embeddings: L2; None: the model's default), `use_activation`
(classify / score: softmax or sigmoid over the head's logits; None: on), and
`truncate_prompt_tokens` (keep the first n tokens of a text, the last n of token ids; -1:
max_model_len). A msgspec Struct, so it crosses the process boundary as msgpack. Types and
ranges are checked when it is made; what depends on the model (`verify_for_model`) when the
input processor sees it.
"""

from __future__ import annotations

import numbers

import msgspec

TASKS = ("embed", "classify", "score")
_INT32_MAX = 2**31 - 1


class PoolingParams(msgspec.Struct, omit_defaults=True):
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # set by LLM.embed / classify / score and the server's endpoints
    # set by the input processor: a cross-encoder pair's token types (0: text 1, 1: text 2)
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
            setattr(self, name, int(value))
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
        if self.dimensions is not None and not 1 <= self.dimensions <= _INT32_MAX:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        keep = self.truncate_prompt_tokens
        if keep is not None and keep != -1 and not 1 <= keep <= _INT32_MAX:
            raise ValueError(
                f"truncate_prompt_tokens must be at least 1 (or -1: the model's length), got {keep}"
            )
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")

    def clone(self) -> PoolingParams:
        return msgspec.structs.replace(self)

    def verify_for_model(
        self,
        model_task: str,
        hidden_size: int,
        matryoshka: bool,
        matryoshka_dimensions: list[int] | None,
        model: str,
    ) -> None:
        """The request's task against the model's (an embedding model embeds; a classifier
        classifies and scores), and `dimensions` against what the model declares."""
        task = self.task or ("embed" if model_task == "embed" else "classify")
        if (task == "embed") != (model_task == "embed"):
            can = "embed" if model_task == "embed" else "classify and score"
            kind = "an embedding" if model_task == "embed" else "a classification"
            raise ValueError(f"{model!r} is {kind} model: it can {can}, not {task}")
        if self.dimensions is None:
            return
        if task != "embed":
            raise ValueError("dimensions applies to embeddings only")
        if not matryoshka:
            raise ValueError(
                f"{model!r} does not support Matryoshka representations (its config declares "
                "no is_matryoshka / matryoshka_dimensions): dimensions cannot be changed"
            )
        if matryoshka_dimensions and self.dimensions not in matryoshka_dimensions:
            raise ValueError(
                f"{model!r} supports dimensions {matryoshka_dimensions}, got {self.dimensions}"
            )
        if self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is more than the model's {hidden_size}")
