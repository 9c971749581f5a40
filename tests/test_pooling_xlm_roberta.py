"""XLM-RoBERTa classification (bge-reranker's architecture, here with three labels): positions
counted from pad_token_id + 1, RoBERTa's classifier head, softmax; against HF's logits."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_tokenizer, widen_weights

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

TEXTS = ["the cat sat on the mat", "why is the sky blue", "hi", "tell me a story"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    path = save_tiny_tokenizer(tmp_path_factory.mktemp("xlmr") / "xlm-roberta-cls")
    config = XLMRobertaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=40, type_vocab_size=1, pad_token_id=0,
                              num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = XLMRobertaForSequenceClassification(config)
    widen_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24)
    yield engine
    engine.shutdown()


def test_classify_equals_hf(llm, folder):
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    outputs = llm.classify(TEXTS, use_tqdm=False)
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits, text in zip(outputs, raw, TEXTS):
        with torch.no_grad():
            expected = hf(torch.tensor([tokenizer.encode(text)])).logits[0]
        assert logits.outputs.probs == pytest.approx(expected.tolist(), abs=1e-4)
        assert out.outputs.probs == pytest.approx(expected.softmax(0).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="classifies into 3 labels: score needs"):
        llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)


def test_a_pad_id_inside_a_prompt_shifts_the_positions_as_hf(llm, folder):
    """HF's RoBERTa counts positions over non-pad tokens (a pad id sits at padding_idx): a
    prompt with the pad id inside (XLM-R's tokenizer reads a literal "<pad>" so), in a batch
    after another prompt, gets HF's logits."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(TEXTS[0])
    padded = ids[:3] + [0, 0] + ids[3:]
    prompts = [{"prompt_token_ids": ids}, {"prompt_token_ids": padded}]
    raw = llm.classify(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    for out, prompt in zip(raw, (ids, padded)):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert out.outputs.probs == pytest.approx(expected.tolist(), abs=1e-4)


def test_positions_end_where_the_table_does(folder):
    """40 position embeddings counted from pad_token_id + 1 = 1: 39 tokens at most."""
    from pagellm import EngineArgs

    config = EngineArgs(model=folder, dtype="float32").create_engine_config()
    assert config.model_config.max_model_len == 39
