"""The pooling endpoints: `POST /v1/embeddings` (OpenAI's), `/classify`, `/score` and
`/rerank` (`/v1/rerank`; Jina / Cohere's shape), vLLM's. Each input is one engine request
(prefill-only); a client that leaves aborts them. A pooling model's task decides what it
serves: an embedding model embeds (and scores by cosine), a classifier classifies and, with
one label, scores and reranks as a cross-encoder; the other requests are a 400 in our words,
as is an input longer than the model without `truncate_prompt_tokens`. A generative model
answers these endpoints 404.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.entrypoints.llm_pooling import cosine_score, pair_prompts, score_pairs
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.generation import until_disconnect
from pagellm.entrypoints.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagellm.entrypoints.openai.response_models import UsageInfo
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, random_id, usage
from pagellm.outputs import PoolingRequestOutput
from pagellm.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    def pooling_model(self, requested: str | None, endpoint: str) -> str:
        """The model's name; a generative model serves no pooling endpoint: 404, as for a
        route it does not have."""
        name = self.model_name(requested)
        if self.engine.config.model_config.pooler_config is None:
            raise APIError(
                f"{name!r} is a generative model: {endpoint} needs a pooling model (an "
                "embedding model or a classifier; `pagellm serve MODEL --runner pooling`)",
                404,
            )
        return name

    async def embeddings(self, request: EmbeddingRequest, raw_request: Request) -> JSONResponse:
        model = self.pooling_model(request.model, "/v1/embeddings")
        prompts = _prompts(request.input)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens,
                               task="embed")  # fmt: skip
        outputs = await self._run_admitted(prompts, params, raw_request)
        data = [
            EmbeddingData(index=i, embedding=_encoded(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        body = EmbeddingResponse(id=random_id("embd"), created=int(time.time()), model=model,
                                 data=data, usage=_usage(outputs))  # fmt: skip
        return JSONResponse(body.model_dump())

    async def classify(self, request: ClassificationRequest, raw_request: Request) -> JSONResponse:
        model = self.pooling_model(request.model, "/classify")
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                               task="classify")  # fmt: skip
        outputs = await self._run_admitted(_prompts(request.input), params, raw_request)
        labels = getattr(self.engine.config.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = int(np.argmax(probs))
            label = labels.get(best, labels.get(str(best)))
            data.append(ClassificationData(index=i, label=label, probs=probs,
                                           num_classes=len(probs)))  # fmt: skip
        body = ClassificationResponse(id=random_id("classify"), created=int(time.time()),
                                      model=model, data=data, usage=_usage(outputs))  # fmt: skip
        return JSONResponse(body.model_dump())

    async def score(self, request: ScoreRequest, raw_request: Request) -> JSONResponse:
        model = self.pooling_model(request.model, "/score")
        scores, outputs = await self._scores(
            request.text_1, request.text_2, request.truncate_prompt_tokens, raw_request
        )
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        body = ScoreResponse(id=random_id("score"), created=int(time.time()), model=model,
                             data=data, usage=_usage(outputs))  # fmt: skip
        return JSONResponse(body.model_dump())

    async def rerank(self, request: RerankRequest, raw_request: Request) -> JSONResponse:
        model = self.pooling_model(request.model, "/rerank")
        scores, outputs = await self._scores(
            request.query, request.documents, request.truncate_prompt_tokens, raw_request
        )
        top_n = request.top_n if request.top_n and request.top_n > 0 else None
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=request.documents[i])
                if request.return_documents
                else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        tokens = _usage(outputs).prompt_tokens
        usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
        body = RerankResponse(id=random_id("rerank"), model=model, usage=usage, results=results)
        return JSONResponse(body.model_dump())

    async def _scores(
        self, text_1: Any, text_2: Any, keep: int | None, raw_request: Request
    ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Each pair's score: a cross-encoder's (the pair as one input), or the cosine of an
        embedding model's two embeddings."""
        texts_1, texts_2 = score_pairs(text_1, text_2)
        mc = self.engine.config.model_config
        if mc.pooler_config.task == "embed":  # one text_1 is embedded once (as vLLM does)
            firsts = texts_1[:1] if isinstance(text_1, str) or len(text_1) == 1 else texts_1
            params = PoolingParams(truncate_prompt_tokens=keep, task="embed")
            outs = await self._run_admitted([*firsts, *texts_2], params, raw_request)
            embs_1, embs_2 = outs[: len(firsts)], outs[len(firsts) :]
            embs_1 = embs_1 * len(embs_2) if len(embs_1) == 1 else embs_1
            return [cosine_score(a, b) for a, b in zip(embs_1, embs_2)], outs
        if mc.pooler_config.num_labels != 1:
            raise ValueError(
                f"{mc.model!r} classifies into {mc.pooler_config.num_labels} labels: score "
                "and rerank need a cross-encoder with one label, or an embedding model"
            )
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pairs of texts cannot be encoded")
        limit = self.max_model_len if keep == -1 else keep
        prompts = await self.off_loop(
            lambda: pair_prompts(self.tokenizer, mc, texts_1, texts_2, limit)
        )
        params = PoolingParams(truncate_prompt_tokens=keep, task="score")
        outs = await self._run_admitted(prompts, params, raw_request)
        return [float(o.outputs.data[0]) for o in outs], outs

    async def _run_admitted(
        self, prompts: list[Any], params: PoolingParams, raw_request: Request
    ) -> list[PoolingRequestOutput]:
        release = self.admit(len(prompts), "inputs to encode (one per text or pair)", None)
        try:
            return await until_disconnect(raw_request, self._run(prompts, params))
        finally:
            release()

    async def _run(self, prompts: list[Any], params: PoolingParams) -> list[PoolingRequestOutput]:
        request_id = random_id("pool")

        async def one(i: int, prompt: Any) -> PoolingRequestOutput:
            async for out in self.engine.encode(prompt, params, f"{request_id}-{i}"):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed or the client left: the others are aborted, not left running
            for task in tasks:
                task.cancel()


def _prompts(inputs: Any) -> list[Any]:
    """A text, texts, token ids or lists of them: one prompt each."""
    if isinstance(inputs, str):
        return [inputs]
    if not inputs:
        raise ValueError("input is empty: send a text, texts, token ids or lists of them")
    if inputs and isinstance(inputs[0], int):
        return [{"prompt_token_ids": inputs}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in inputs]


def _encoded(data: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # as OpenAI's: float32, little-endian
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def _usage(outputs: list[PoolingRequestOutput]) -> UsageInfo:
    return usage(sum(len(o.prompt_token_ids) for o in outputs), 0)
