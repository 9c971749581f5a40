"""LLM.classify and LLM.score on a decoder cross-encoder: a tiny random
Qwen3ForSequenceClassification with one label (HF's `score` Linear on the last token),
against HF's logits, through the real engine."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_tokenizer

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

QUERY = "why is the sky blue"
DOCS = ["the sky is blue", "the cat sat on the mat", "tell me a story"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    path = str(tmp_path_factory.mktemp("cls") / "qwen3-reranker")
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        pad_token_id=0, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # logits of a useful size
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", max_num_batched_tokens=8, max_model_len=32,
                 kv_cache_memory_bytes=1 << 24)  # fmt: skip
    yield engine
    engine.shutdown()


def _hf_logit(hf, ids: list[int]) -> float:
    with torch.no_grad():
        return float(hf(torch.tensor([ids])).logits[0, 0])


def test_classify_equals_hf(llm, hf):
    tokenizer = llm.get_tokenizer()
    outputs = llm.classify(DOCS, use_tqdm=False)
    raw = llm.classify(DOCS, PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits, doc in zip(outputs, raw, DOCS):
        expected = _hf_logit(hf, tokenizer.encode(doc))
        assert logits.outputs.probs == pytest.approx([expected], abs=1e-4)
        assert out.outputs.num_classes == 1
        sigmoid = 1 / (1 + torch.exp(torch.tensor(-expected)))
        assert out.outputs.probs[0] == pytest.approx(float(sigmoid), abs=1e-5)


def test_score_pairs_as_the_tokenizer_pairs_them(llm, hf):
    tokenizer = llm.get_tokenizer()
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    expected = [_hf_logit(hf, tokenizer(QUERY, doc)["input_ids"]) for doc in DOCS]
    got = [s.outputs.score for s in scores]
    assert got == pytest.approx(torch.sigmoid(torch.tensor(expected)).tolist(), abs=1e-5)
    pairwise = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    assert len(pairwise) == 2
    with pytest.raises(ValueError, match="one text with many, or N texts with N"):
        llm.score([QUERY, QUERY], DOCS, use_tqdm=False)


def test_refusals(llm):
    with pytest.raises(ValueError, match="a classification model: it can classify and score, not"):
        llm.embed(QUERY, use_tqdm=False)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.classify(" ".join(["the cat sat on the mat"] * 6), use_tqdm=False)
    (out,) = llm.classify(" ".join(["the cat sat on the mat"] * 6), use_tqdm=False,
                          pooling_params=PoolingParams(truncate_prompt_tokens=-1))  # fmt: skip
    assert len(out.prompt_token_ids) == 32
