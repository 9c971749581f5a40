"""A BERT cross-encoder (reranker): a tiny random BertForSequenceClassification with one
label; LLM.score against HF's logits of the pair (token types 0 / 1), LLM.classify."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_bert_cross_encoder

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

QUERY = "why is the sky blue"
DOCS = ["the sky is blue", "the cat sat on the mat", "tell me a story", "hi"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_bert_cross_encoder(tmp_path_factory.mktemp("ce") / "bert-reranker")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24)
    yield engine
    engine.shutdown()


def _logits(hf, tokenizer, *texts) -> torch.Tensor:
    encoded = tokenizer(*texts, return_tensors="pt")
    with torch.no_grad():
        return hf(**encoded).logits[0]


def test_score_equals_hf_cross_encoder(llm, hf):
    tokenizer = llm.get_tokenizer()
    scores = [s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)]
    logits = torch.stack([_logits(hf, tokenizer, QUERY, doc)[0] for doc in DOCS])
    assert scores == pytest.approx(torch.sigmoid(logits).tolist(), abs=1e-5)
    # the rerank order is HF's, and token types count: the swapped pair scores differently
    assert sorted(range(4), key=lambda i: -scores[i]) == logits.argsort(descending=True).tolist()
    encoded = tokenizer(QUERY, DOCS[0], return_tensors="pt")
    encoded["token_type_ids"].zero_()
    with torch.no_grad():
        untyped = torch.sigmoid(hf(**encoded).logits[0, 0])
    assert abs(float(untyped) - scores[0]) > 1e-3  # HF's score needs the token types


def test_classify_and_truncated_pairs(llm, hf):
    tokenizer = llm.get_tokenizer()
    (raw,) = llm.classify(DOCS[1], PoolingParams(use_activation=False), use_tqdm=False)
    assert raw.outputs.probs == pytest.approx(_logits(hf, tokenizer, DOCS[1]).tolist(), abs=1e-4)
    long_doc = "the cat sat on the mat " * 6
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.score(QUERY, long_doc, use_tqdm=False)
    (out,) = llm.score(QUERY, long_doc, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(out.prompt_token_ids) == 32
    encoded = tokenizer(QUERY, long_doc, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(hf(**encoded).logits[0, 0])
    assert out.outputs.score == pytest.approx(float(expected), abs=1e-5)


def test_token_types_outside_the_table_are_refused_and_the_engine_serves(llm):
    for prompt, match in (
        ({"prompt_token_ids": [2, 9, 3], "token_type_ids": [0, 5, 5]}, "type_vocab_size"),
        ({"prompt_token_ids": [2, 9, 10, 3], "token_type_ids": [0, 1]}, "2 for 4 prompt tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.classify(prompt, use_tqdm=False)
    assert len(llm.classify(DOCS[0], use_tqdm=False)[0].outputs.probs) == 1


def test_the_configs_cross_encoder_activation(folder, hf, tmp_path):
    """ST's `activation_fn` (and <4.0's `sbert_ce_default_activation_function`, which the
    ms-marco rerankers carry): Identity scores are the raw logits, as CrossEncoder.predict."""
    import json
    import shutil

    copy = shutil.copytree(folder, tmp_path / "identity")
    config = json.loads((copy / "config.json").read_text())
    config["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (copy / "config.json").write_text(json.dumps(config))
    with LLM(str(copy), dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24) as llm:
        tokenizer = llm.get_tokenizer()
        scores = [s.outputs.score for s in llm.score(QUERY, DOCS[:2], use_tqdm=False)]
    logits = [float(_logits(hf, tokenizer, QUERY, doc)[0]) for doc in DOCS[:2]]
    assert scores == pytest.approx(logits, abs=1e-5)


def test_a_sentence_transformers_6_activation_and_an_empty_pair(folder, hf, tmp_path):
    """sentence-transformers 6 saves a CrossEncoder's activation in
    config_sentence_transformers.json (not config.json): Identity scores are the raw logits.
    A pair with an empty text is still a pair ([CLS] a [SEP] [SEP], as ST tokenizes it; HF
    given two strings reads "" as no pair)."""
    import json
    import shutil

    copy = shutil.copytree(folder, tmp_path / "st6")
    st6 = {"activation_fn": "torch.nn.modules.linear.Identity", "model_type": "CrossEncoder"}
    (copy / "config_sentence_transformers.json").write_text(json.dumps(st6))
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer"}]  # fmt: skip
    (copy / "modules.json").write_text(json.dumps(modules))
    with LLM(str(copy), dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24) as llm:
        tokenizer = llm.get_tokenizer()
        scores = [s.outputs.score for s in llm.score([QUERY, ""], [DOCS[0], ""], use_tqdm=False)]
    pair = tokenizer([""], [""], return_tensors="pt")
    assert pair["input_ids"].shape[1] == 3  # [CLS] [SEP] [SEP]
    with torch.no_grad():
        empty = float(hf(**pair).logits[0, 0])
    assert scores == pytest.approx([float(_logits(hf, tokenizer, QUERY, DOCS[0])[0]), empty],
                                   abs=1e-5)  # fmt: skip


def test_truncation_below_the_special_tokens_is_refused(llm):
    """HF cannot cut a pair below its [CLS] / [SEP]s and returns it whole: scoring its last
    token would be a number about nothing."""
    with pytest.raises(ValueError, match="fewer than a pair's special tokens \\(3\\)"):
        llm.score(QUERY, DOCS[0], truncate_prompt_tokens=1, use_tqdm=False)
    with pytest.raises(ValueError, match="fewer than the tokenizer's special tokens \\(2\\)"):
        llm.classify(DOCS[0], PoolingParams(truncate_prompt_tokens=1), use_tqdm=False)
    assert len(llm.classify(DOCS[0], use_tqdm=False)[0].outputs.probs) == 1


def test_pair_prompts_read_as_the_model_reads_them(tmp_path):
    """LLM.score and the server's /score and /rerank build a pair alike: token types only
    where the model has more than one (an XLM-R cross-encoder with type_vocab_size=1 and a
    BERT tokenizer: the server sent types 1 and failed "token_type_ids must be in [0, 1)")."""
    from types import SimpleNamespace

    from model_utils import save_tiny_wordpiece
    from transformers import AutoTokenizer

    from pagellm.config import PoolerConfig
    from pagellm.entrypoints.llm_pooling import pair_prompts

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_wordpiece(tmp_path / "tok"))

    def config(types: int):
        pooler = PoolerConfig(pooling_type="CLS", task="classify")
        return SimpleNamespace(hf_config=SimpleNamespace(type_vocab_size=types),
                               pooler_config=pooler)  # fmt: skip

    bert = pair_prompts(tokenizer, config(2), ["why"], ["the sky"], 32)[0]
    assert set(bert["token_type_ids"]) == {0, 1}
    xlmr = pair_prompts(tokenizer, config(1), ["why"], ["the sky"], 32)[0]
    assert "token_type_ids" not in xlmr and xlmr["prompt_token_ids"] == bert["prompt_token_ids"]
