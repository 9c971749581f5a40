"""An encoder embedding model: a tiny random BertModel saved by sentence-transformers with
mean pooling and Normalize (a MiniLM's layout), against sentence-transformers' `encode`;
its prompts run whole in one step, never chunked, with no KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_utils import close, save_tiny_wordpiece, st_modules

from pagellm import LLM

TEXTS = ["the cat sat on the mat", "why is the sky blue", "hi", "tell me a story " * 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel

    path = save_tiny_wordpiece(tmp_path_factory.mktemp("bert") / "minilm")
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    modules = st_modules()
    pipeline = [modules.Transformer(path), modules.Pooling(64, "mean"), modules.Normalize()]
    SentenceTransformer(modules=pipeline).save(path)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", max_model_len=16, max_num_batched_tokens=24,
                 kv_cache_memory_bytes=1 << 24)  # fmt: skip
    yield engine
    engine.shutdown()


def test_embed_equals_sentence_transformers(llm, folder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(folder, device="cpu").encode(TEXTS)
    outputs = llm.embed(TEXTS, use_tqdm=False)  # 4 prompts over a 24-token budget: 2+ steps
    for out, ref in zip(outputs, reference):
        close(out.outputs.embedding, ref)
    assert llm.llm_engine.config.scheduler_config.enable_chunked_prefill is False
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching


def test_too_long_is_refused_or_truncated(llm, folder):
    from sentence_transformers import SentenceTransformer

    text = "the cat sat on the mat " * 4  # 26 tokens with [CLS] and [SEP]
    with pytest.raises(ValueError, match="longer than the maximum model length of 16"):
        llm.embed(text, use_tqdm=False)
    (out,) = llm.embed(text, use_tqdm=False, truncate_prompt_tokens=-1)
    assert len(out.prompt_token_ids) == 16 and out.prompt_token_ids[-1] == 3  # [SEP] kept
    st = SentenceTransformer(folder, device="cpu")
    st.max_seq_length = 16
    close(out.outputs.embedding, st.encode([text])[0])
    assert np.linalg.norm(out.outputs.embedding) == pytest.approx(1, abs=1e-5)


def test_an_encoder_budget_must_hold_a_prompt(folder):
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(8\\) must be at least"):
        LLM(folder, dtype="float32", max_model_len=16, max_num_batched_tokens=8)


def test_attention_per_request_equals_the_padded_batch():
    """The CPU's per-request attention (a few requests a step) and the padded batch (many,
    and CUDA) give each token the same output: its own request's keys only."""
    from pagellm.models.bert import PaddedLayout, RequestSlices

    qsl = np.array([0, 5, 6, 19, 27])  # 4 requests of 5, 1, 13, 8 tokens
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(27, 4 * 8, generator=gen) for _ in range(3))
    padded = PaddedLayout(qsl, 27, torch.device("cpu")).attend(q, k, v, 4)
    sliced = RequestSlices(qsl).attend(q, k, v, 4)
    torch.testing.assert_close(sliced, padded, atol=1e-5, rtol=1e-5)
    alone = RequestSlices(qsl[:2]).attend(q[:5], k[:5], v[:5], 4)  # the first request alone
    torch.testing.assert_close(sliced[:5], alone)
    assert RequestSlices.use_slices(qsl, torch.device("cpu"))
    assert not RequestSlices.use_slices(np.arange(40), torch.device("cpu"))


def test_sentence_transformers_max_seq_length_bounds_the_model(folder, tmp_path):
    """ST truncates to its max_seq_length (all-MiniLM-L6-v2: 256 of 512 positions): the
    engine's max_model_len follows it, and a truncated embedding is ST's."""
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    copy = shutil.copytree(folder, tmp_path / "short")
    settings = json.loads((copy / "sentence_bert_config.json").read_text())
    (copy / "sentence_bert_config.json").write_text(json.dumps({**settings, "max_seq_length": 8}))
    text = "the cat sat on the mat why is the sky blue"
    reference = SentenceTransformer(str(copy), device="cpu").encode([text])[0]
    with LLM(str(copy), dtype="float32", kv_cache_memory_bytes=1 << 24) as llm:
        assert llm.llm_engine.config.model_config.max_model_len == 8
        (out,) = llm.embed(text, use_tqdm=False, truncate_prompt_tokens=-1)
    close(out.outputs.embedding, reference)
    with pytest.raises(ValueError, match="max_seq_length"):
        LLM(str(copy), dtype="float32", max_model_len=16)


def test_an_encoder_is_not_split_over_ranks(folder):
    """Encoders build plain Linears: under tensor_parallel_size=2 every rank would hold and
    run the whole model, so it is refused at start-up."""
    from pagellm import EngineArgs

    args = EngineArgs(model=folder, tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="is an encoder, which is not split over ranks"):
        args.create_engine_config()
