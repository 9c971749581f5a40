"""Mean pooling and Matryoshka dimensions: a causal LM checkpoint (its LM head left unread)
served with runner="pooling" and sentence-transformers 5.x's files (mean pooling, Normalize)
and `matryoshka_dimensions` in its config, against HF's hidden states; prompts chunked over
steps, the prefix cache off (mean pools every token)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_utils import make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

TEXTS = ["the cat sat on the mat why is the sky blue", "hi", "tell me a story"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = make_tiny_hf_model("llama", tmp_path_factory.mktemp("mean"), vocab_size=64, std=0.1)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["matryoshka_dimensions"] = [16, 32]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_tiny_tokenizer(path)
    os.makedirs(os.path.join(path, "1_Pooling"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
               "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}  # fmt: skip
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, runner="pooling", dtype="float32", max_num_batched_tokens=4,
                 kv_cache_memory_bytes=1 << 24)  # fmt: skip
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_means(folder, llm):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    means = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([llm.get_tokenizer().encode(text)])
            means.append(hf(ids).last_hidden_state[0].mean(0))
    return means


def test_mean_pooling_over_chunks(llm, hf_means):
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching
    for _ in range(2):  # the second time: nothing cached stands in for computed tokens
        outputs = llm.embed(TEXTS, use_tqdm=False)
        for out, mean in zip(outputs, hf_means):
            ours = torch.tensor(out.outputs.embedding)
            expected = F.normalize(mean, dim=0)
            assert F.cosine_similarity(ours, expected, dim=0) >= 0.99999
            assert (ours - expected).abs().max() <= 2e-5


def test_matryoshka_dimensions(llm, hf_means):
    outputs = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    for out, mean in zip(outputs, hf_means):
        assert out.outputs.hidden_size == 16
        expected = F.normalize(mean[:16], dim=0)
        np.testing.assert_allclose(out.outputs.embedding, expected.numpy(), atol=2e-5)
    with pytest.raises(ValueError, match="supports dimensions \\[16, 32\\], got 8"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
