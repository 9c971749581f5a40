"""RoBERTa classifiers (XLM-R's layout, served by its classes) and HF's `problem_type`:
multi-label classification takes a sigmoid per label, regression the raw logit (HF's
text-classification pipeline, vLLM's classify); an encoder's other HF activation names."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_tokenizer, widen_weights

from pagellm import LLM

TEXTS = ["the cat sat on the mat", "why is the sky blue", "hi"]


def _folder(root, name: str, **overrides) -> str:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    path = save_tiny_tokenizer(root / name)
    config = RobertaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=40, pad_token_id=0, **overrides)  # fmt: skip
    torch.manual_seed(0)
    model = RobertaForSequenceClassification(config)
    widen_weights(model)
    model.save_pretrained(path)
    return path


def _hf_logits(folder: str, tokenizer, text: str) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokenizer.encode(text)])).logits[0]


@pytest.mark.parametrize(
    "problem_type, labels, act",
    [("multi_label_classification", 3, torch.sigmoid), ("regression", 1, lambda x: x)],
)
def test_problem_type_sets_classify_activation(tmp_path, problem_type, labels, act):
    folder = _folder(tmp_path, problem_type, num_labels=labels, problem_type=problem_type,
                     hidden_act="silu")  # fmt: skip
    with LLM(folder, dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24) as llm:
        outputs = llm.classify(TEXTS, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    for out, text in zip(outputs, TEXTS):
        expected = act(_hf_logits(folder, tokenizer, text))
        assert out.outputs.probs == pytest.approx(expected.tolist(), abs=1e-5)


def test_an_activation_not_served_is_named(tmp_path):
    from pagellm.models.bert import activation

    config = type("Config", (), {"hidden_act": "prelu"})()
    with pytest.raises(ValueError, match="hidden_act='prelu' is not served for encoders"):
        activation(config, "hidden_act")
