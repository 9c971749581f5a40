"""Greedy CPU steps from an 8-bit copy of a tied float32 LM head (`pagellm.sample.greedy_head`):
the bound holds at any scale, the argmax is the float head's (ties to the lower id), it steps
aside when it cannot narrow or the step has many rows, and an engine with it gives the ids of
one without it (and HF's) with greedy, sampled, logprob and penalised requests mixed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model

from pagellm import LLM, SamplingParams
from pagellm.quantization import gguf_kernel
from pagellm.sample.greedy_head import MAX_ROWS, GreedyHead

pytestmark = pytest.mark.skipif(not gguf_kernel.supported(), reason="needs the GGUF block kernel")


def _head(v: int, h: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of different scales: each row's own error bound matters
    scale = torch.rand(v, 1, generator=g) * 0.2 + 0.01
    return torch.randn(v, h, generator=g) * scale


@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 1e3])
def test_every_approximate_logit_is_within_its_bound(x_scale):
    w = _head(1000, 96)
    head = GreedyHead(w)
    x = torch.randn(8, 96) * x_scale
    x[0, :5] = 40 * x_scale  # an outlier feature, as final norms give
    approx = gguf_kernel.block_gemm(x, head.planes)
    exact = F.linear(x.double(), w.double())  # the real value; the model's is within rounding
    bound = x.abs().sum(-1, keepdim=True) * head.row_bound
    assert ((approx.double() - exact).abs() <= bound.double()).all()


def test_argmax_equals_the_float_heads():
    w = _head(4096, 128, seed=1)
    head = GreedyHead(w)
    for seed in range(8):
        x = torch.randn(MAX_ROWS, 128, generator=torch.Generator().manual_seed(seed))
        got = head.argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert got.tolist() == F.linear(x, w).argmax(-1).tolist()


def test_twins_and_near_twins_of_the_winner():
    """A winner's exact copy elsewhere is a tie in real arithmetic (which of the two a float
    GEMM puts first depends on its blocking, as for the full head): either id. A near twin
    1e-4 above the winner along x, far inside the 8-bit error and far above float32 rounding
    (~1e-6 here), must win, as it does for the float64 logits."""
    w = _head(2048, 64, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    top = F.linear(x.double(), w.double()).argmax(-1).tolist()
    w[2000] = w[top[0]]  # row 0: the winner copied to a higher id
    w[3] = w[top[1]]  # row 1: to a lower id
    w[1000] = w[top[2]] + 1e-4 * x[2] / x[2].norm() ** 2  # row 2: a near twin
    got = GreedyHead(w).argmax(x).tolist()
    assert got[0] in (top[0], 2000) and got[1] in (top[1], 3) and got[2] == 1000
    assert F.linear(x.double(), w.double()).argmax(-1).tolist()[2] == 1000


def test_a_floor_that_rises_row_after_row():
    """Logits that grow with the id (each chunk's best beats the last's): the rows kept as
    candidates are pruned as the floor rises, and the winner is still the last row; the
    reverse order keeps only the first rows. Three rows of x, two threads' ranges."""
    v, h = 8192, 64
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(4))
    ramp = torch.linspace(0, 1, v)[:, None]
    w = _head(v, h, seed=5) * 1e-3 + ramp * x[0] / x[0].norm() ** 2 * 50
    assert GreedyHead(w).argmax(x).tolist() == F.linear(x, w).argmax(-1).tolist()
    assert GreedyHead(w).argmax(x[:1]).tolist() == [v - 1]
    assert GreedyHead(w.flip(0).contiguous()).argmax(x[:1]).tolist() == [0]


def test_it_steps_aside_when_it_cannot_narrow_or_rows_are_many():
    w = _head(512, 64, seed=3)
    head = GreedyHead(w)
    assert head.argmax(torch.randn(MAX_ROWS, 64)) is not None
    assert head.argmax(torch.randn(MAX_ROWS + 1, 64)) is None  # the float head's GEMM is cheaper
    x = torch.randn(2, 64)
    x[1, 0] = float("nan")
    assert head.argmax(x) is None  # a non-finite row
    w[5] = 1e7  # its blocks' scales overflow fp16
    assert GreedyHead(w).argmax(torch.randn(1, 64)) is None
    flat = GreedyHead(torch.ones(512, 64) * 0.01 + torch.randn(512, 64) * 1e-4)
    assert flat.argmax(torch.randn(1, 64)) is None  # every row within the bound: too many


def test_engine_ids_equal_without_it_and_hf(tmp_path, monkeypatch):
    """A tied tiny Llama in float32, MAX_ROWS requests at once: greedy requests alone take
    the shortcut; a batch that mixes sampled, logprob and penalised requests computes the
    logits (the sampler's results unchanged); greedy ids equal the engine's without it and
    HF's. A bf16 engine does not build it (its head is half the bytes already)."""
    from pagellm.sample import greedy_head

    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model("llama", tmp_path, std=0.3, tie_word_embeddings=True)
    prompts = [[5 + i, 17, 3 * i + 2, 40, 9] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    mixed = [
        greedy,
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
    ]
    calls = []  # whether each call found the argmax
    argmax = greedy_head.GreedyHead.argmax

    def counted(self, hidden):
        ids = argmax(self, hidden)
        calls.append(ids is not None)
        return ids

    monkeypatch.setattr(greedy_head.GreedyHead, "argmax", counted)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGELLM_CPU_GREEDY_HEAD", flag)
        with LLM(folder, dtype="float32", max_model_len=64, max_num_seqs=MAX_ROWS) as llm:
            assert (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                    .model_runner.greedy_head is not None) == (flag == "1")  # fmt: skip
            batch = [{"prompt_token_ids": p} for p in prompts]
            plain = llm.generate(batch, greedy, use_tqdm=False)
            n_plain = len(calls)
            out = llm.generate(batch[:4], mixed, use_tqdm=False)
        runs[flag] = [o.outputs[0].token_ids for o in plain + out]
        runs[flag + "lp"] = out[2].outputs[0].logprobs
        if flag == "1":  # every greedy step found it; the mixed batch never asked
            assert n_plain >= 24 and all(calls) and len(calls) == n_plain
    assert runs["1"] == runs["0"]
    assert len(runs["1lp"]) == 12 and runs["1lp"] == runs["0lp"]
    hf = hf_model(folder, torch.float32)
    assert runs["1"][:6] == hf_generate_greedy(hf, prompts, 12)
    monkeypatch.setenv("PAGELLM_CPU_GREEDY_HEAD", "1")
    with LLM(folder, dtype="bfloat16", max_model_len=64) as llm:
        assert (
            llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.greedy_head
            is None
        )
