"""Pooling models on the GPU, judged as the project judges a family in bf16: pagellm in bf16
is no further from HF in float32 than HF's own bf16 run is, on the same weights, in one test.

Models (random, seeded, saved into tmp_path, sentence-transformers' `modules.json` and
`1_Pooling/config.json` written here: no sentence-transformers on the GPU machines):
- a BertModel with mean pooling (MiniLM's layout) and a Qwen3Model with last-token pooling
  (Qwen3-Embedding's), both normalized: embeddings in bf16 and float32 (a);
- a BERT cross-encoder (`LLM.score` on pairs, token types 0 / 1) and a 3-label
  Qwen3ForSequenceClassification (`LLM.classify` raw logits) (b);
- many prompts of mixed lengths at once, over several steps (async scheduling, batching, a
  decode-only step of one-token prompts on a CUDA graph, prefix-cache hits) against the same
  prompts one at a time (c).

HF runs each prompt alone (no padding); its peer pools its bf16 states in float32 as we do.
Measures: the mean cosine distance and the max-abs difference over the prompts' unit vectors
(logits / scores: the mean abs difference). Two correct bf16 runs round at different points
(ours: fused q | k | v and gate | up GEMMs, float32 norms and pooling), so ours may be up to
SLACK times the peer's distance, plus a floor far below what a wrong mask, position or token
type makes (those move unit vectors by > 0.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_utils import make_bert_cross_encoder, save_tiny_tokenizer, save_tiny_wordpiece

from pagellm import LLM
from pagellm.pooling_params import PoolingParams

pytestmark = pytest.mark.gpu

# prompt lengths: one-token rows, either side of the 16-token KV blocks, a long one
LENGTHS = (1, 2, 5, 9, 16, 17, 24, 31, 33, 47, 64, 80, 100, 127)
SLACK, COS_FLOOR, ABS_FLOOR = 2.0, 1e-6, 1e-3
ENGINE = dict(device="cuda", max_model_len=128, max_num_seqs=64, max_num_batched_tokens=256,
              kv_cache_memory_bytes=1 << 26)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def in_process():
    """The engine core in the test's process (as test_gpu_e2e runs it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        yield


def _randomize(model: torch.nn.Module, std: float) -> None:
    """Weights large enough that attention and every layer move the states."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name.lower() and name.endswith("weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def _write_st_files(folder: str, hidden: int, mode: str) -> None:
    """sentence-transformers' pipeline: Transformer, Pooling(`mode`), Normalize."""
    kinds = ["Transformer", "Pooling", "Normalize"]
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
               for i, (k, p) in enumerate(zip(kinds, paths))]  # fmt: skip
    Path(folder, "modules.json").write_text(json.dumps(modules))
    Path(folder, "1_Pooling").mkdir()
    config = {"word_embedding_dimension": hidden, "pooling_mode": mode}
    Path(folder, "1_Pooling", "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> str:
    from transformers import BertConfig, BertModel

    path = save_tiny_wordpiece(tmp_path_factory.mktemp("bert") / "minilm")
    config = BertConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=256,
                        max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = BertModel(config)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    _write_st_files(path, 128, "mean")
    return path


def _qwen3_config(**extra):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        pad_token_id=0, **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> str:
    from transformers import AutoModel

    path = str(tmp_path_factory.mktemp("qwen3") / "qwen3-embedding")
    model = AutoModel.from_config(_qwen3_config(architectures=["Qwen3Model"]))
    _randomize(model, 0.1)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    _write_st_files(path, 128, "lasttoken")
    return path


def prompts(kind: str, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    """Token ids of random words: BERT's wrapped in [CLS] .. [SEP] (ids 2, 3; words from 5),
    the word-level tokenizer's words from id 6."""
    gen = np.random.default_rng(seed)
    if kind == "bert":
        return [[2, *gen.integers(5, 23, max(n - 2, 0)).tolist(), 3][-n:] for n in lengths]
    return [gen.integers(6, 24, n).tolist() for n in lengths]


@torch.no_grad()
def hf_embed(folder: str, dtype: torch.dtype, batch: list[list[int]], mode: str) -> np.ndarray:
    """HF's states of each prompt alone, pooled in float32 and normalized: [N, hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=dtype).cuda().eval()
    rows = []
    for ids in batch:
        states = model(input_ids=torch.tensor([ids], device="cuda")).last_hidden_state[0]
        pooled = states.float().mean(0) if mode == "mean" else states[-1].float()
        rows.append(F.normalize(pooled, dim=-1).cpu())
    return torch.stack(rows).double().numpy()


def distances(vectors: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(mean cosine distance, max-abs difference) of unit vectors [N, hidden]."""
    norms = np.linalg.norm(vectors, axis=-1) * np.linalg.norm(reference, axis=-1)
    cosine = (vectors * reference).sum(-1) / norms  # [N]
    return float(np.mean(1 - cosine)), float(np.abs(vectors - reference).max())


def embed(llm: LLM, batch: list[list[int]]) -> np.ndarray:
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in batch], use_tqdm=False)
    return np.array([out.outputs.embedding for out in outputs], np.float64)


@pytest.fixture(scope="module")
def engines(bert_folder, qwen3_folder):
    """The bf16 engines of both embedding models (CUDA graphs, async scheduling on)."""
    llms = {"bert": LLM(bert_folder, dtype="bfloat16", **ENGINE)}
    llms["qwen3"] = LLM(qwen3_folder, dtype="bfloat16", **ENGINE)
    yield llms
    for llm in llms.values():
        llm.shutdown()


MODES = {"bert": "mean", "qwen3": "lasttoken"}


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_embeddings_bf16_as_close_to_hf_float32_as_hf_bf16(kind, engines, request):
    folder = request.getfixturevalue(f"{kind}_folder")
    batch = prompts(kind)
    reference = hf_embed(folder, torch.float32, batch, MODES[kind])
    peer = distances(hf_embed(folder, torch.bfloat16, batch, MODES[kind]), reference)
    ours = distances(embed(engines[kind], batch), reference)
    print(f"\n{kind} vs HF fp32 (cosine distance, max-abs): HF bf16 {peer}, ours bf16 {ours}")
    assert ours[0] <= SLACK * peer[0] + COS_FLOOR, (ours, peer)
    assert ours[1] <= SLACK * peer[1] + ABS_FLOOR, (ours, peer)
    with LLM(folder, dtype="float32", **ENGINE) as llm32:
        exact = distances(embed(llm32, batch), reference)
    assert exact[0] <= 1e-5 and exact[1] <= 2e-3, exact  # float32: HF's own values


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_many_mixed_requests_at_once_equal_one_at_a_time(kind, engines):
    """Batched over several steps (256 tokens a step) vs alone; for the decoder also
    one-token prompts alone in a step (decode-only: a CUDA graph padded past them)."""
    llm = engines[kind]
    batch = prompts(kind, lengths=[LENGTHS[i % len(LENGTHS)] for i in range(48)], seed=1)
    if kind == "qwen3":
        batch += [[token] for token in range(6, 11)]
    together = embed(llm, batch)
    alone = np.concatenate([embed(llm, [ids]) for ids in batch])
    cosine, max_abs = distances(together, alone)
    assert cosine <= 1e-4 and max_abs <= 0.03, (cosine, max_abs)
    assert np.abs(together[:-1] - together[1:]).max() > 0.1  # distinct prompts, distinct rows
    if kind == "qwen3":
        singles = batch[-5:]
        cosine, max_abs = distances(embed(llm, singles), together[-5:])
        assert cosine <= 1e-4 and max_abs <= 0.03, (cosine, max_abs)


def _mean_abs(values, reference) -> float:
    return float(np.abs(np.asarray(values, np.float64) - np.asarray(reference)).mean())


@torch.no_grad()
def test_cross_encoder_scores_bf16(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = make_bert_cross_encoder(tmp_path / "bert-reranker")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = "the cat sat on mat why is sky blue tell me story hi hello a".split()
    gen = np.random.default_rng(3)
    docs = [" ".join(gen.choice(words, int(n))) for n in gen.integers(1, 20, 16)]
    query = "why is the sky blue"

    def hf_scores(dtype):
        hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).cuda()
        pairs = [tokenizer(query, doc, return_tensors="pt").to("cuda") for doc in docs]
        return [torch.sigmoid(hf.eval()(**p).logits[0, 0].float()).item() for p in pairs]

    reference = hf_scores(torch.float32)
    peer = _mean_abs(hf_scores(torch.bfloat16), reference)
    with LLM(folder, dtype="bfloat16", device="cuda", max_model_len=64,
             kv_cache_memory_bytes=1 << 26) as llm:  # fmt: skip
        ours = _mean_abs([s.outputs.score for s in llm.score(query, docs, use_tqdm=False)],
                         reference)  # fmt: skip
    print(f"\ncross-encoder score vs HF fp32 (mean abs): HF bf16 {peer}, ours {ours}")
    assert ours <= SLACK * peer + ABS_FLOOR


@torch.no_grad()
def test_qwen3_classifier_logits_bf16(tmp_path):
    from transformers import AutoModelForSequenceClassification

    folder = str(tmp_path / "qwen3-classifier")
    model = AutoModelForSequenceClassification.from_config(_qwen3_config(num_labels=3))
    _randomize(model, 0.1)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    batch = prompts("qwen3", lengths=LENGTHS[1:], seed=4)

    def hf_logits(dtype):
        hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).cuda()
        rows = [hf.eval()(torch.tensor([ids], device="cuda")).logits[0] for ids in batch]
        return torch.stack(rows).float().cpu().numpy()

    reference = hf_logits(torch.float32)
    peer = _mean_abs(hf_logits(torch.bfloat16), reference)
    with LLM(folder, dtype="bfloat16", **ENGINE) as llm:
        raw = PoolingParams(use_activation=False)
        outputs = llm.classify([{"prompt_token_ids": ids} for ids in batch], raw, use_tqdm=False)
    ours = _mean_abs([out.outputs.probs for out in outputs], reference)
    print(f"\nQwen3 classifier logits vs HF fp32 (mean abs): HF bf16 {peer}, ours {ours}")
    assert ours <= SLACK * peer + ABS_FLOOR * float(np.abs(reference).mean())
