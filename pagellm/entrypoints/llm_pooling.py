"""LLM's pooling methods (vLLM's): `encode`, `embed`, `classify` and `score`.

A pooling model (`LLM(model, runner="pooling")`, or a checkpoint that is one) runs each
prompt as a prefill-only request and returns one vector per prompt: an embedding, a
classifier's probabilities, or a score. `score(text_1, text_2)` pairs texts 1 -> N or N -> N:
an embedding model scores the cosine of the two embeddings, a cross-encoder (a classifier
with one label) the pair tokenized together as its tokenizer pairs texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pagellm.engine.input_processor import PromptType
from pagellm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagellm.pooling_params import PoolingParams


class PoolingMethods:
    """Mixed into `LLM`: needs its `llm_engine`, `_request_counter` and `_stream`."""

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector, as the model's task (or `pooling_task`) makes it."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = _params_for(len(prompt_list), pooling_params, pooling_task)
        added: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception:
            self.llm_engine.abort_request(added)  # all or nothing: the engine stays clean
            raise
        finished: dict[str, PoolingRequestOutput] = {}
        bar = tqdm(total=len(added), desc="Processed prompts", disable=not use_tqdm)
        try:
            for out in self._stream(added):
                finished[out.request_id] = out
                bar.update(1)
        finally:
            bar.close()
        return [finished[r] for r in added]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings (`.outputs.embedding`): pooled, cut to `dimensions` and normalized as
        the model's sentence-transformers files (or the params) say."""
        params = _with_truncation(pooling_params, truncate_prompt_tokens)
        outputs = self.encode(prompts, params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities (`.outputs.probs`: softmax, sigmoid for one
        label; the raw logits with use_activation=False)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """`data_1` against each of `data_2` (one to many, or pairwise): a cross-encoder's
        relevance, or an embedding model's cosine similarity (`.outputs.score`)."""
        texts_1, texts_2 = score_pairs(data_1, data_2)
        params = _with_truncation(pooling_params, truncate_prompt_tokens) or PoolingParams()
        mc = self.llm_engine.config.model_config
        if mc.pooler_config is None:
            raise ValueError(
                f"{mc.model!r} is a generative model: score needs a pooling model "
                "(LLM(..., runner='pooling'))"
            )
        if mc.pooler_config.task == "embed":
            return self._embedding_score(texts_1, texts_2, params, use_tqdm)
        return self._cross_encoder_score(texts_1, texts_2, params, use_tqdm)

    def _embedding_score(
        self, texts_1: list[str], texts_2: list[str], params: PoolingParams, use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        outs = self.encode([*texts_1, *texts_2], params, use_tqdm, pooling_task="embed")
        firsts, seconds = outs[: len(texts_1)], outs[len(texts_1) :]
        scores = []
        for a, b in zip(firsts, seconds):
            cosine = torch.tensor([cosine_score(a, b)])
            ids = a.prompt_token_ids + b.prompt_token_ids
            base = PoolingRequestOutput(f"{a.request_id}_{b.request_id}", PoolingOutput(cosine),
                                        ids)  # fmt: skip
            scores.append(ScoringRequestOutput.from_base(base))
        return scores

    def _cross_encoder_score(
        self, texts_1: list[str], texts_2: list[str], params: PoolingParams, use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        mc = self.llm_engine.config.model_config
        if mc.pooler_config.num_labels != 1:
            raise ValueError(
                f"{mc.model!r} classifies into {mc.pooler_config.num_labels} labels: score needs "
                "a cross-encoder with one label (or an embedding model)"
            )
        tokenizer = self.get_tokenizer()
        keep = params.truncate_prompt_tokens
        keep = mc.max_model_len if keep == -1 else keep
        prompts = pair_prompts(tokenizer, mc, texts_1, texts_2, keep)
        outputs = self.encode(prompts, params, use_tqdm, pooling_task="score")
        return [ScoringRequestOutput.from_base(o) for o in outputs]


def cosine_score(a: PoolingRequestOutput, b: PoolingRequestOutput) -> float:
    """An embedding model's score of two texts: their embeddings' cosine."""
    return float(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0))


def pair_prompts(
    tokenizer: Any, mc: Any, texts_1: list[str], texts_2: list[str], max_length: int | None
) -> list[dict[str, list[int]]]:
    """A cross-encoder's inputs for pairs of texts (LLM.score and the server's /score and
    /rerank alike): read as sentence-transformers reads them, with token types where the
    model has more than one (XLM-R's type_vocab_size=1 reads none: a BERT tokenizer's pair
    types, 1 for text 2, would index past its table)."""
    st_text, typed = mc.pooler_config.st_text, getattr(mc.hf_config, "type_vocab_size", 2) > 1
    return [pair_prompt(tokenizer, st_text(a), st_text(b), max_length, typed)
            for a, b in zip(texts_1, texts_2)]  # fmt: skip


def pair_prompt(
    tokenizer: Any, text_1: str, text_2: str, max_length: int | None, typed: bool = True
) -> dict[str, list[int]]:
    """The two texts as the tokenizer encodes a pair (a cross-encoder's input: its ids and,
    where it has them, token types), truncated (the longer text first) to `max_length`."""
    # as a batch of one pair, as sentence-transformers calls it (called with two strings HF
    # reads an empty text 2 as no pair: [CLS] a [SEP] where the pair is [CLS] a [SEP] [SEP])
    if max_length is None:
        encoded = tokenizer([text_1], [text_2])
    else:
        encoded = tokenizer([text_1], [text_2], truncation=True, max_length=max_length)
    encoded = {key: value[0] for key, value in encoded.items()}
    if max_length is not None:
        if len(encoded["input_ids"]) > max_length:  # HF could not: fewer than its specials
            raise ValueError(
                f"truncate_prompt_tokens ({max_length}) is fewer than a pair's special tokens "
                f"({tokenizer.num_special_tokens_to_add(pair=True)}): pass more, or -1"
            )
    prompt = {"prompt_token_ids": encoded["input_ids"]}
    if typed and encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = encoded["token_type_ids"]
    return prompt


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> tuple[list, list]:
    texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    if len(texts_1) != len(texts_2) or not texts_2:
        raise ValueError(
            f"score pairs one text with many, or N texts with N: got {len(texts_1)} and "
            f"{len(texts_2)}"
        )
    return texts_1, texts_2


def _with_truncation(
    params: PoolingParams | Sequence[PoolingParams] | None, keep: int | None
) -> PoolingParams | Sequence[PoolingParams] | None:
    if keep is None:
        return params
    if params is None:
        return PoolingParams(truncate_prompt_tokens=keep)
    if isinstance(params, PoolingParams):
        params = params.clone()
        params.truncate_prompt_tokens = keep
        return params
    raise ValueError("pass truncate_prompt_tokens in each PoolingParams, not beside a list")


def _params_for(
    n: int, params: PoolingParams | Sequence[PoolingParams] | None, task: str | None
) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        params = [params or PoolingParams()] * n
    elif len(params) != n:
        raise ValueError(f"got {len(params)} pooling params for {n} prompts")
    out = []
    for p in params:
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling params must be PoolingParams, got {type(p).__name__}")
        p = p.clone()
        p.task = task or p.task
        PoolingParams.__post_init__(p)  # the changed fields checked again
        out.append(p)
    return out
