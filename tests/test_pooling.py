"""LLM.embed on a decoder embedding model: a tiny random Qwen3Model saved by
sentence-transformers (last-token pooling, Normalize), against sentence-transformers' own
`encode` and HF's hidden states, through the real engine (prompts chunked over steps)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_utils import close, make_st_embedding_model

from pagellm import LLM, SamplingParams
from pagellm.pooling_params import PoolingParams

TEXTS = [
    "the cat sat on the mat",
    "why is the sky blue",
    "tell me a story hi hello the cat sat on a mat why is sky blue",
    "hi",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_st_embedding_model(tmp_path_factory.mktemp("emb") / "qwen3-embedding")


@pytest.fixture(scope="module")
def st_model(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu")


@pytest.fixture(scope="module")
def llm(folder):
    # runner "auto": the Qwen3Model checkpoint is a pooling model; 8 tokens a step: chunked
    engine = LLM(folder, dtype="float32", max_num_batched_tokens=8, max_model_len=16, block_size=4,
                 kv_cache_memory_bytes=1 << 24)  # fmt: skip
    yield engine
    engine.shutdown()


def test_embed_equals_sentence_transformers(llm, st_model):
    outputs = llm.embed(TEXTS, use_tqdm=False)
    reference = st_model.encode(TEXTS)
    assert len(outputs) == len(TEXTS)
    for out, ref, text in zip(outputs, reference, TEXTS):
        assert out.outputs.hidden_size == 64
        assert out.prompt_token_ids == llm.get_tokenizer().encode(text)
        close(out.outputs.embedding, ref)
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5


def test_prefix_cache_hits_give_the_same_embeddings(llm, st_model):
    """LAST pooling keeps the prefix cache: a repeated prompt computes only its last tokens."""
    assert llm.llm_engine.config.cache_config.enable_prefix_caching
    first, again = (llm.embed(TEXTS[2], use_tqdm=False)[0] for _ in range(2))
    assert len(again.prompt_token_ids) == 16 and again.num_cached_tokens == 12  # 3 blocks of 4
    close(again.outputs.embedding, st_model.encode(TEXTS[2]))
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-6)


def test_unnormalized_is_hf_last_hidden_state(llm, folder):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode(TEXTS[2])
    (out,) = llm.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False), use_tqdm=False)
    with torch.no_grad():
        last = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    close(out.outputs.embedding, last.numpy())
    assert np.linalg.norm(out.outputs.embedding) > 1.5  # not normalized


def test_truncation_keeps_the_first_tokens_of_a_text(llm, st_model):
    long_text = " ".join(["the cat sat on the mat"] * 4)  # 24 tokens > max_model_len 16
    with pytest.raises(ValueError, match="longer than the maximum model length.*truncate"):
        llm.embed(long_text, use_tqdm=False)
    (out,) = llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=5)
    assert len(out.prompt_token_ids) == 5
    st_model.max_seq_length = 5
    try:
        reference = st_model.encode([long_text])[0]
    finally:
        st_model.max_seq_length = 64
    close(out.outputs.embedding, reference)
    with pytest.raises(ValueError, match="truncate_prompt_tokens \\(17\\) is more than"):
        llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=17)
    (whole,) = llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=-1)
    assert len(whole.prompt_token_ids) == 16


def test_refusals_leave_the_engine_serving(llm):
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling model.*does not generate"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="an embedding model: it can embed, not classify"):
        llm.classify(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)
    (out,) = llm.embed(TEXTS[1], use_tqdm=False)
    assert out.outputs.hidden_size == 64
    assert not llm.llm_engine.has_unfinished_requests()


def test_score_is_the_cosine_of_embeddings(llm):
    scores = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    first, *others = llm.embed(TEXTS[:3], use_tqdm=False)
    for score, other in zip(scores, others):
        expected = np.dot(first.outputs.embedding, other.outputs.embedding)
        assert score.outputs.score == pytest.approx(expected, abs=1e-5)


def test_default_prompt_and_truncate_dim_as_sentence_transformers(folder, tmp_path):
    """config_sentence_transformers.json's default prompt goes before every text, and its
    truncate_dim cuts the normalized embeddings (not normalized again), as ST's encode;
    a request's `dimensions` still takes its own cut."""
    import shutil

    from sentence_transformers import SentenceTransformer

    copy = shutil.copytree(folder, tmp_path / "prompted")
    path = copy / "config_sentence_transformers.json"
    config = json.loads(path.read_text())
    config.update(prompts={"query": "why is the ", "document": ""}, default_prompt_name="query",
                  truncate_dim=16)  # fmt: skip
    path.write_text(json.dumps(config))
    hf_config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**hf_config, "is_matryoshka": True}))
    want = SentenceTransformer(str(copy), device="cpu").encode(TEXTS[:2])
    assert want.shape == (2, 16) and abs(float(np.linalg.norm(want[0])) - 1) > 1e-3
    with LLM(str(copy), dtype="float32", max_model_len=32, kv_cache_memory_bytes=1 << 24) as llm:
        got = np.stack([o.outputs.embedding for o in llm.embed(TEXTS[:2], use_tqdm=False)])
        cut = llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)[0]
    for ours, ref in zip(got, want):
        close(ours, ref)
    assert len(cut.outputs.embedding) == 8


def test_dense_modules_after_pooling_as_sentence_transformers(folder, tmp_path):
    """Dense modules between Pooling and Normalize (stella's and LaBSE's layout): a linear
    without bias and Identity, then one with bias and Tanh, each pooled vector through them
    in order; `dimensions` is checked against the last one's 16 outputs."""
    from model_utils import st_modules
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(folder, device="cpu")
    modules = st_modules()
    torch.manual_seed(1)
    first = modules.Dense(64, 48, bias=False, activation_function=torch.nn.Identity())
    second = modules.Dense(48, 16, activation_function=torch.nn.Tanh())
    for dense in (first, second):
        torch.nn.init.normal_(dense.linear.weight, std=0.3)
    model = SentenceTransformer(modules=[st[0], st[1], first, second, modules.Normalize()])
    model.save(str(tmp_path / "dense"))
    want = SentenceTransformer(str(tmp_path / "dense"), device="cpu").encode(TEXTS[:3])
    assert want.shape == (3, 16)
    with LLM(str(tmp_path / "dense"), dtype="float32", max_model_len=32,
             kv_cache_memory_bytes=1 << 24) as llm:  # fmt: skip
        got = [o.outputs.embedding for o in llm.embed(TEXTS[:3], use_tqdm=False)]
        with pytest.raises(ValueError, match="does not support Matryoshka"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    for ours, ref in zip(got, want):
        close(ours, ref)


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    """Both ST layouts: 6.x's `pooling_mode`, 5.x's boolean keys; no Normalize: raw."""
    from types import SimpleNamespace

    from pagellm.loader.pooler_config import load_pooler_config, resolve_runner

    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    legacy = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], matryoshka_dimensions=[8, 16])
    assert resolve_runner("auto", str(tmp_path), hf) == "pooling"
    config = load_pooler_config(str(tmp_path), hf)
    assert (config.pooling_type, config.normalize) == ("MEAN", False)
    assert config.matryoshka and config.matryoshka_dimensions == [8, 16]
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    assert load_pooler_config(str(tmp_path), hf).pooling_type == "CLS"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="pooling mode"):
        load_pooler_config(str(tmp_path), hf)
    params = PoolingParams(dimensions=12)
    with pytest.raises(ValueError, match="supports dimensions \\[8, 16\\]"):
        params.verify_for_model("embed", 64, True, [8, 16], "m")
    assert resolve_runner("auto", None, hf) == "generate"


def test_sentence_transformers_length_case_and_modules(tmp_path):
    """sentence_bert_config.json's max_seq_length and do_lower_case are read (ST truncates to
    the length and lowercases); a module after Pooling that is not Dense or Normalize (a
    projection) is refused rather than skipped."""
    from types import SimpleNamespace

    from pagellm.loader.pooler_config import load_pooler_config

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    settings = {"max_seq_length": 8, "do_lower_case": True}
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(settings))
    hf = SimpleNamespace(architectures=["BertModel"])
    config = load_pooler_config(str(tmp_path), hf)
    assert (config.max_seq_length, config.lowercase) == (8, True)
    modules.append({"idx": 2, "name": "2", "path": "2_Router",
                    "type": "sentence_transformers.base.modules.router.Router"})  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Router"):
        load_pooler_config(str(tmp_path), hf)
