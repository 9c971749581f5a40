"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator)
in every attention path against one float32 reference written from HF's eager attention
(the sink appended as a last score column, its weight dropped): the Triton paged kernel under
the interpreter (decodes, prefill chunks after a context, GQA, a sliding window, split-KV
decodes merged by the combine kernel) and the torch backend's two CPU paths (the in-place
C++ kernel, the gather + torch path).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import DEVICE, TOL, Batch, assert_close  # first: sets TRITON_INTERPRET=1

from pagellm.attention import cpu_decode
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kernels.paged_attention import paged_attention
from pagellm.kernels.reshape_and_cache import reshape_and_cache

# numpy's warning for rows past a request's query that see no key: computed, never stored
interpreter_rows_past_query = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in divide:RuntimeWarning"
)


def reference_with_sinks(q, k, v, context_len, scale, window, sinks) -> torch.Tensor:
    """q [ql, H, D], k / v [seq_len, H_kv, D] -> [ql, H, D], float32, as HF's eager gpt-oss
    attention: scores, mask, the head's sink as one more column, softmax, that column
    dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, ql, L]
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, -math.inf)
    column = sinks.float().cpu()[:, None, None].expand(-1, q.shape[0], 1)
    weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, v)


class SinkBatch(Batch):
    """test_kernels' Batch with a sink per query head (large: N(0, 2)) and an optional
    window."""

    def __init__(self, *args, window: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.window = window
        gen = torch.Generator().manual_seed(11)
        self.sinks = (torch.randn(self.num_heads, generator=gen) * 2).to(DEVICE)
        self.fresh_cache = self.kv_cache.clone()  # before this step's K/V are written

    def run(self, num_splits: int | None = None) -> torch.Tensor:
        n = self.num_actual_tokens
        reshape_and_cache(self.k[:n], self.v[:n], self.kv_cache, self.slot_mapping)
        out = torch.full_like(self.q[:n], float("nan"))
        plan = self.plan(sliding_window=self.window, num_splits=num_splits)
        paged_attention(
            self.q[:n], self.kv_cache, self.block_table, self.seq_lens_t, self.query_start_loc,
            self.scale, plan=plan, out=out, sinks=self.sinks,
        )  # fmt: skip
        return out

    def torch_backend(self) -> torch.Tensor:
        n = self.num_actual_tokens
        backend = TorchAttentionBackend(
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
            sliding_window=self.window,
        )  # fmt: skip
        metadata = TorchAttentionBackend.build_metadata(self.common())
        q, k, v = self.q[:n], self.k[:n], self.v[:n]
        return backend.forward(q, k, v, self.fresh_cache, metadata, sinks=self.sinks)

    def reference(self, sinks: torch.Tensor | None = None) -> torch.Tensor:
        sinks = self.sinks if sinks is None else sinks
        outs = []
        for r, ctx in enumerate(self.context_lens):
            q = self.q[self.qsl_cpu[r] : self.qsl_cpu[r + 1]].cpu()
            outs.append(reference_with_sinks(
                q, self.keys[r], self.values[r], ctx, self.scale, self.window, sinks
            ))  # fmt: skip
        return torch.cat(outs)


SCENARIOS = {
    "decode": ([1, 1, 1], [37, 5, 90]),
    "mixed": ([1, 24, 1, 13], [70, 0, 3, 30]),
}


@interpreter_rows_past_query
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,window,dtype",
    [(4, 2, None, torch.float32), (8, 2, 20, torch.float32), (4, 4, None, torch.float16)],
)
def test_kernel_sinks(scenario, num_heads, num_kv_heads, window, dtype):
    query_lens, context_lens = SCENARIOS[scenario]
    batch = SinkBatch(query_lens, context_lens, num_heads, num_kv_heads, 32, 16, dtype,
                      window=window, seed=5)  # fmt: skip
    assert_close(batch.run(), batch.reference(), dtype)


@interpreter_rows_past_query
@pytest.mark.parametrize("window", [None, 40])
def test_kernel_sinks_split_kv(window):
    """Split-KV decodes: the sink joins the merged sum in the combine kernel, once."""
    batch = SinkBatch([1, 1], [300, 120], 8, 2, 32, 16, torch.float32, window=window, seed=6)
    assert [launch.num_splits for launch in batch.plan(num_splits=4).launches] == [4]
    assert_close(batch.run(num_splits=4), batch.reference(), torch.float32)


def test_reference_sinks_matter():
    """At these sinks the output moves far past the tolerance (so the tests above check
    the sinks)."""
    batch = SinkBatch(*SCENARIOS["mixed"], 4, 2, 32, 16, torch.float32)
    moved = (batch.reference() - batch.reference(torch.full_like(batch.sinks, -1e9))).abs()
    assert moved.max() > 100 * TOL[torch.float32]


@pytest.mark.parametrize("in_place", [True, False], ids=["cpp-kernel", "gather"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("head_dim", [32, 64])  # the C++ kernel's scalar and vector loops
def test_torch_backend_sinks(in_place, window, head_dim, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU paths")
    if in_place and cpu_decode.kernel() is None:
        pytest.skip("no C++ paged attention kernel here")
    monkeypatch.setattr(TorchAttentionBackend, "in_place", in_place)
    batch = SinkBatch(*SCENARIOS["mixed"], 8, 2, head_dim, 16, torch.float32, window=window, seed=7)
    torch.testing.assert_close(batch.torch_backend(), batch.reference(), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_bad_sinks():
    batch = SinkBatch(*SCENARIOS["decode"], 4, 2, 32, 16, torch.float32)
    batch.sinks = batch.sinks[:3]
    with pytest.raises(ValueError, match="sinks must be a contiguous float32"):
        batch.run()
