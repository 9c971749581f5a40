"""ModernBERT: a tiny random ModernBertForSequenceClassification (mean pooling, three
labels; global layers alternating with a local band of 4 tokens either side), against HF's
logits, through the real engine."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_wordpiece, widen_weights

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

TEXTS = ["the cat sat on the mat " * 3, "why is the sky blue", "hi"]  # 20, 7, 3 tokens


def _config(global_every: int = 2):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=96, local_attention=8, global_attn_every_n_layers=global_every,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        cls_token_id=2, sep_token_id=3, classifier_pooling="mean", num_labels=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from transformers import ModernBertForSequenceClassification

    path = save_tiny_wordpiece(tmp_path_factory.mktemp("mbert") / "modernbert-cls")
    torch.manual_seed(0)
    model = ModernBertForSequenceClassification(_config())
    widen_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", kv_cache_memory_bytes=1 << 24)
    yield engine
    engine.shutdown()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_classify_equals_hf(llm, folder):
    from transformers import ModernBertForSequenceClassification

    hf = ModernBertForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    probs = llm.classify(TEXTS, use_tqdm=False)
    for logits, out, text in zip(raw, probs, TEXTS):
        expected = _hf_logits(hf, tokenizer.encode(text))
        assert logits.outputs.probs == pytest.approx(expected.tolist(), abs=1e-4)
        assert out.outputs.probs == pytest.approx(expected.softmax(0).tolist(), abs=1e-5)
    # the local band matters: with every layer global, HF's logits of the long text differ
    window_less = ModernBertForSequenceClassification(_config(global_every=1))
    window_less.load_state_dict(hf.state_dict())
    ids = tokenizer.encode(TEXTS[0])
    assert (_hf_logits(window_less.eval(), ids) - _hf_logits(hf, ids)).abs().max() > 1e-3
