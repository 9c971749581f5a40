"""`pagellm serve` of a pooling model (a sentence-transformers Qwen3 embedding model):
`/v1/embeddings` through the openai SDK (float and base64) against sentence-transformers'
`encode`, `/score` and `/rerank` by cosine, and the clear 400s (a generation endpoint,
`dimensions` on a model without Matryoshka, inputs longer than the model), the server
serving on."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from model_utils import close, make_st_embedding_model
from server_utils import API_KEY, error_of, post, start_server, stop_server, wait_healthy

TEXTS = ["the cat sat on the mat", "why is the sky blue", "hi"]
LONG = "the cat sat on the mat " * 4  # 24 tokens, over --max-model-len 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_st_embedding_model(tmp_path_factory.mktemp("srv") / "qwen3-embedding")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    args = [folder, "--dtype", "float32", "--max-model-len", "16", "--api-key", API_KEY]
    args += ["--kv-cache-memory-bytes", str(1 << 24)]
    srv = start_server(args, str(tmp_path_factory.mktemp("pool") / "server.log"))
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu").encode(TEXTS)


def test_openai_sdk_embeddings(server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    # "float", and the SDK's default: it asks for base64 and decodes it itself
    for options in ({"encoding_format": "float"}, {}):
        result = client.embeddings.create(model=model, input=TEXTS, **options)
        assert [d.index for d in result.data] == [0, 1, 2]
        for data, ref in zip(result.data, reference):
            close(data.embedding, ref)
        assert result.usage.prompt_tokens == result.usage.total_tokens == 6 + 5 + 1
    raw = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64")
    close(np.frombuffer(base64.b64decode(raw.data[0].embedding), "<f4"), reference[0])
    ids = post(server, "/tokenize", {"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = post(server, "/v1/embeddings", {"input": [ids]}).json()
    close(by_ids["data"][0]["embedding"], reference[1])


def test_score_and_rerank(server, reference):
    cosines = [float(reference[0] @ r) for r in reference[1:]]
    scores = post(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(cosines, abs=1e-5)
    for path in ("/rerank", "/v1/rerank"):
        body = {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
        results = post(server, path, body).json()["results"]
        best = int(np.argmax(cosines))
        assert [r["index"] for r in results] == [best]
        assert results[0]["document"]["text"] == TEXTS[1 + best]
        assert results[0]["relevance_score"] == pytest.approx(cosines[best], abs=1e-5)
        usage = post(server, path, body).json()["usage"]
        # vLLM's RerankUsage; the query embedded once (6 + 5 + 1 tokens), not once a document
        assert usage["prompt_tokens"] == usage["total_tokens"] == 12
    # vLLM's other spellings of the two sides
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        body = {first: TEXTS[0], second: TEXTS[1:]}
        assert [d["score"] for d in post(server, "/score", body).json()["data"]] == pytest.approx(
            cosines, abs=1e-5
        )


def test_clear_400s_and_the_server_serves_on(server, reference):
    error = error_of(post(server, "/v1/embeddings", {"input": LONG}), 400)
    assert "longer than the maximum model length of 16" in error["message"]
    truncated = post(server, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 16
    error = error_of(post(server, "/v1/embeddings", {"input": "hi", "dimensions": 8}), 400)
    assert "does not support Matryoshka" in error["message"]
    error = error_of(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 400)
    assert "pooling model" in error["message"]
    error = error_of(post(server, "/classify", {"input": "hi"}), 400)
    assert "it can embed, not classify" in error["message"]
    error_of(post(server, "/score", {"text_1": "hi"}), 400)
    error = error_of(post(server, "/v1/embeddings", {"input": "\ud800 hi"}), 400)
    assert "valid Unicode" in error["message"]
    error_of(post(server, "/v1/embeddings", {"input": "hi"}, headers={}), 401)
    for empty in ([], [[]]):  # the schema says so (was a 400 the schema did not state)
        error = error_of(post(server, "/v1/embeddings", {"input": empty}), 400)
        assert "at least 1 item" in error["message"]
    body = {"input": "hi", "truncate_prompt_tokens": 0}  # every member of the union named
    error = error_of(post(server, "/v1/embeddings", body), 400)
    assert "Input should be -1 or greater than or equal to 1" in error["message"]
    ok = post(server, "/v1/embeddings", {"input": TEXTS[2]}).json()
    close(ok["data"][0]["embedding"], reference[2])


def test_bench_serve_embeddings(server):
    """`pagellm bench serve --backend openai-embeddings` (vLLM's name) loads /v1/embeddings:
    requests counted, latencies measured; a prompt over the model's length fails, counted."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pagellm", "bench", "serve", "--url", server.url,
           "--backend", "openai-embeddings", "--num-prompts", "6", "--concurrency", "3",
           "--token-range", "3", "60", "--api-key", API_KEY]  # fmt: skip
    out = subprocess.run(cmd + ["--input-len", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["input_throughput"] > 0 and summary["e2el_ms_p50"] > 0
    assert summary["output_throughput"] == 0 and "E2EL" in out.stdout and "TTFT" not in out.stdout
    long = subprocess.run(cmd + ["--input-len", "40"], capture_output=True, text=True, timeout=120)
    summary = json.loads(long.stdout.strip().splitlines()[-1])
    assert long.returncode == 1 and summary["failed"] == 6 and "HTTP 400" in summary["first_error"]
