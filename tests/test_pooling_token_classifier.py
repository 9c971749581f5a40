"""A causal LM served as a reranker (Qwen3-Reranker's way, vLLM's `hf_overrides`): a tiny
random Qwen3ForCausalLM whose LM-head rows of two tokens ([no, yes]; here "hi", "hello")
become a one-label score head: sigmoid(yes - no) = the softmax over the two of HF's
next-token logits."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM

QUERY = "why is the sky blue"
DOCS = ["the sky is blue", "the cat sat on the mat", "tell me a story"]
OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["hi", "hello"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qr"), vocab_size=64, std=0.1)
    return save_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", hf_overrides=OVERRIDES, kv_cache_memory_bytes=1 << 24)
    yield engine
    engine.shutdown()


def test_reranker_scores_are_the_tokens_softmax(llm, folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["hi", "hello"])
    scores = [s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)]
    for score, doc in zip(scores, DOCS):
        ids = tokenizer(QUERY, doc)["input_ids"]  # the pair as the tokenizer pairs it
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        assert score == pytest.approx(float(logits[[no, yes]].softmax(0)[1]), abs=1e-5)
    assert max(scores) - min(scores) > 1e-3  # scores that tell the documents apart
    assert llm.llm_engine.config.model_config.pooler_config.num_labels == 1


def test_unknown_token_is_refused(folder):
    overrides = {**OVERRIDES, "classifier_from_token": ["hi", "zebra"]}
    with pytest.raises(ValueError, match="are not all tokens of the vocabulary"):
        LLM(folder, dtype="float32", hf_overrides=overrides)
