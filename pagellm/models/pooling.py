"""A decoder family as a pooling model: the same layers without the LM head.

`as_pooling_model(LlamaForCausalLM)` embeds: its forward's final hidden states are pooled by
the runner (`pagellm/worker/pooler.py`), and `pool_head` passes the pooled vector through.
`as_pooling_model(..., classify=True)` is HF's `*ForSequenceClassification`: a bias-free
`score` Linear over the pooled (last token's) state. Checkpoints come as a causal LM's
(`model.*`, an `lm_head` left unread), as AutoModel saves a bare decoder (no `model.` prefix),
or as a classifier's (`model.*` and `score.weight`); a causal LM served as a classifier
(`hf_overrides`' `classifier_from_token`, Qwen3-Reranker) has its LM head's token rows as the
score head.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.weights import CheckpointTensor, set_param


@functools.cache
def as_pooling_model(base: type[nn.Module], classify: bool = False) -> type[nn.Module]:
    """`base` (a `LlamaForCausalLM` subclass) without its LM head, plus a score head."""

    class PoolingModel(base):
        def __init__(self, config: Any, attn_backend_cls: type) -> None:
            super().__init__(config, attn_backend_cls)
            if hasattr(self, "lm_head"):
                del self.lm_head
            self.tie_word_embeddings = False  # nothing to tie: no head packs the embedding
            if classify:
                self.score = nn.Linear(config.hidden_size, num_labels(config), bias=False)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a pooling model has no LM head: it does not sample")

        def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """pooled: [N, hidden] float32 -> [N, num_labels] logits, or the embedding."""
            if not classify:
                return pooled
            return F.linear(pooled, self.score.weight.float())

        def load_weights(self, weights: Any) -> set[str]:
            token_ids = getattr(self.config, "classifier_from_token_ids", None)
            if not (classify and token_ids):
                return super().load_weights((_model_name(name), t) for name, t in weights)
            tied = bool(getattr(self.config, "tie_word_embeddings", False))
            head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            loaded: set[str] = set()

            def rows_to_score() -> Any:
                for name, tensor in weights:
                    name = _model_name(name)
                    if name == head:  # the LM head's rows of the tokens: the score head
                        self._score_from_rows(CheckpointTensor(tensor).read(), token_ids)
                        loaded.add("score.weight")
                    yield name, tensor

            return loaded | super().load_weights(rows_to_score())

        def _score_from_rows(self, head: torch.Tensor, token_ids: list[int]) -> None:
            """vLLM's `classifier_from_token`: the rows of those tokens; Qwen3-Reranker's
            original form, one row: yes - no (its sigmoid is softmax([no, yes])'s yes)."""
            rows = head[token_ids]  # [n, hidden]
            if getattr(self.config, "is_original_qwen3_reranker", False):
                rows = rows[1:2] - rows[0:1]
            set_param(self.score, "weight", rows.to(self.score.weight.dtype))

        def _skip_weight(self, name: str) -> bool:
            return name.startswith("lm_head.") or super()._skip_weight(name)

    PoolingModel.__name__ = PoolingModel.__qualname__ = base.__name__.replace(
        "ForCausalLM", "ForSequenceClassification" if classify else "ForEmbedding"
    )
    return PoolingModel


def _model_name(name: str) -> str:
    """A bare decoder's tensor names (AutoModel's `layers.0...`) under `model.`."""
    if name.startswith(("model.", "lm_head.", "score.")):
        return name
    return "model." + name


def num_labels(config: Any) -> int:
    """A classifier's outputs: HF's `num_labels` is its `id2label`'s size (a config view
    keeps only the dict)."""
    return len(getattr(config, "id2label", None) or {}) or getattr(config, "num_labels", 2)
