"""`pagellm serve` of a BERT cross-encoder (a reranker): `/rerank` and `/v1/rerank` in HF's
order with its scores, `/score` pairs with their token types, `/classify`; a generation
endpoint and `/v1/embeddings` on it are clear 400s."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_bert_cross_encoder
from server_utils import API_KEY, error_of, post, start_server, stop_server, wait_healthy

QUERY = "why is the sky blue"
DOCS = ["the sky is blue", "the cat sat on the mat", "tell me a story", "hi"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_bert_cross_encoder(tmp_path_factory.mktemp("rr") / "bert-reranker")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    args = [folder, "--dtype", "float32", "--max-model-len", "32", "--api-key", API_KEY]
    srv = start_server(args, str(tmp_path_factory.mktemp("rerank") / "server.log"))
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def hf_scores(folder) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = [hf(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0] for doc in DOCS]
    return torch.sigmoid(torch.stack(logits)).tolist()


def test_rerank_and_score_equal_hf(server, hf_scores):
    order = sorted(range(len(DOCS)), key=lambda i: -hf_scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # vLLM's names
        body = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == order[:3]
        for result in body["results"]:
            assert result["relevance_score"] == pytest.approx(hf_scores[result["index"]], abs=1e-5)
            assert result["document"]["text"] == DOCS[result["index"]]
        assert body["usage"]["total_tokens"] > 0
    for top_n in (0, -1):  # every document, as vLLM answers
        body = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": top_n}).json()
        assert [r["index"] for r in body["results"]] == order
    for path in ("/score", "/v1/score"):
        data = post(server, path, {"text_1": QUERY, "text_2": DOCS}).json()["data"]
        assert [d["score"] for d in data] == pytest.approx(hf_scores, abs=1e-5)


def test_classify_and_clear_400s(server, hf_scores):
    data = post(server, "/classify", {"input": ["hi", "the cat"]}).json()["data"]
    assert [d["num_classes"] for d in data] == [1, 1] and data[0]["label"] == "LABEL_0"
    assert 0 < data[0]["probs"][0] < 1
    long = "the cat sat on the mat " * 6
    error = error_of(post(server, "/rerank", {"query": QUERY, "documents": [long]}), 400)
    assert "longer than the maximum model length of 32" in error["message"]
    body = {"query": QUERY, "documents": [long], "truncate_prompt_tokens": -1}
    assert post(server, "/rerank", body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error = error_of(post(server, "/v1/chat/completions", chat), 400)
    assert "is a pooling model: it serves /classify, /score and /rerank" in error["message"]
    error = error_of(post(server, "/v1/embeddings", {"input": "hi"}), 400)
    assert "it can classify and score, not embed" in error["message"]
    again = post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0]}).json()["data"]
    assert again[0]["score"] == pytest.approx(hf_scores[0], abs=1e-5)
