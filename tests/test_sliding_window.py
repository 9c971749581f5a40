"""Sliding-window attention, logit soft-capping and custom scales.

- the torch backend and the paged Triton kernel (under Triton's interpreter on CPU) against
  a naive reference, with every cache slot outside all of a request's windows NaN-poisoned
  (a read of one shows up as NaN in the output);
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from test_kernels import DEVICE, Batch, assert_close  # first: sets TRITON_INTERPRET=1 on CPU

from pagellm.attention.base import CommonAttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_backend import TritonAttentionBackend
from pagellm.kernels import paged_attention as kernels
from pagellm.kernels.reshape_and_cache import reshape_and_cache


def reference_attention(
    q: torch.Tensor,  # [ql, H, D]
    k: torch.Tensor,  # [seq_len, H_kv, D]: context then query tokens
    v: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [ql, H, D]
    """Per request, in float32: HF's mask (key k visible to query p iff p - W < k <= p)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class WindowCase:
    """A flat batch of (query_len, context_len) requests over random blocks of a NaN cache:
    only context positions some query of the request may see are written."""

    def __init__(self, reqs, heads, kv_heads, head_dim, block_size, window, seed):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.reqs, self.heads, self.kv_heads, self.head_dim = reqs, heads, kv_heads, head_dim
        self.block_size, self.window = block_size, window
        seq_lens = [q + c for q, c in reqs]
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 2  # spare blocks stay poisoned
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.tables = [[ids.pop() for _ in range(n)] for n in blocks_per_req]
        self.kv = [torch.randn(2, s, kv_heads, head_dim, generator=gen) for s in seq_lens]
        self.q = [torch.randn(q, heads, head_dim, generator=gen) for q, _ in reqs]
        shape = TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
        self.cache = torch.full(shape, float("nan"))
        flat = self.cache.view(2, -1, kv_heads, head_dim)
        for r, (_, ctx) in enumerate(reqs):
            first = 0 if window is None else max(0, ctx - window + 1)
            for p in range(first, ctx):
                flat[:, self.slot(r, p)] = self.kv[r][:, p]

    def slot(self, r: int, pos: int) -> int:
        return self.tables[r][pos // self.block_size] * self.block_size + pos % self.block_size

    def common(self) -> CommonAttentionMetadata:
        query_lens = [q for q, _ in self.reqs]
        seq_lens = np.array([q + c for q, c in self.reqs], dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        table = torch.zeros(len(self.reqs), max(len(t) for t in self.tables), dtype=torch.int32)
        for r, t in enumerate(self.tables):
            table[r, : len(t)] = torch.tensor(t)
        slots = [self.slot(r, p) for r, (q, c) in enumerate(self.reqs) for p in range(c, c + q)]
        return CommonAttentionMetadata(
            num_reqs=len(self.reqs),
            block_size=self.block_size,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(query_lens),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq_lens),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([kv[0, c:] for kv, (_, c) in zip(self.kv, self.reqs)])
        v = torch.cat([kv[1, c:] for kv, (_, c) in zip(self.kv, self.reqs)])
        return k, v

    def expected(self, scale: float, soft_cap: float | None) -> torch.Tensor:
        return torch.cat([
            reference_attention(q, kv[0], kv[1], c, scale, self.window, soft_cap)
            for q, kv, (_, c) in zip(self.q, self.kv, self.reqs)
        ])  # fmt: skip


# (query_len, context_len): prompts longer than the window, chunks after a context shorter
# and longer than the window, decodes before and past it
WINDOW_MIX = [(1, 3), (20, 0), (1, 30), (6, 4), (9, 25), (1, 7), (3, 0), (1, 11), (12, 40)]


@pytest.mark.parametrize("window", [1, 5, 8, 64])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (8, 2, 1), (6, 1, 16)])
def test_torch_backend_window_and_soft_cap(window, soft_cap, heads, kv_heads, block_size):
    reqs = list(WINDOW_MIX)
    random.Random(window).shuffle(reqs)
    case = WindowCase(reqs, heads, kv_heads, 16, block_size, window, seed=window + heads)
    scale = 0.37  # not head_dim ** -0.5: the scale is the layer's
    backend = TorchAttentionBackend(
        heads, kv_heads, 16, scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    common = case.common()
    metadata = TorchAttentionBackend.build_metadata(common)
    out = backend.forward(torch.cat(case.q), *case.new_kv(), case.cache, metadata)
    torch.testing.assert_close(out, case.expected(scale, soft_cap), atol=1e-5, rtol=1e-5)
    if window < common.max_seq_len:  # built once per window, reused by every layer
        assert metadata.windowed(window) is metadata.windowed(window) is not metadata


def test_torch_backend_soft_cap_bites():
    """Scores far beyond the cap: capped attention differs from plain attention."""
    case = WindowCase([(5, 0), (1, 9)], 2, 2, 16, 4, None, seed=1)
    case.q = [q * 30 for q in case.q]
    outs = []
    for cap in (None, 1.0):
        backend = TorchAttentionBackend(2, 2, 16, 0.25, logits_soft_cap=cap)
        metadata = TorchAttentionBackend.build_metadata(case.common())
        outs.append(backend.forward(torch.cat(case.q), *case.new_kv(), case.cache, metadata))
        torch.testing.assert_close(outs[-1], case.expected(0.25, cap), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs[0], outs[1], atol=1e-2)


# ---------------------------------------------------------------- the paged Triton kernel

# numpy's warning for rows past a request's query that see no key: computed, never stored
interpreter_rows_past_query = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in divide:RuntimeWarning"
)


class WindowBatch(Batch):
    """test_kernels' Batch for a windowed layer: every context key outside the request's
    windows is NaN, and block-table entries of blocks wholly outside them point to a NaN
    block (as after the KV cache manager freed those blocks)."""

    def __init__(
        self, *args, window: int, soft_cap: float | None = None, poison: bool = True, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.window, self.soft_cap, self.scale = window, soft_cap, 0.29
        if poison:
            self._poison_outside_windows()

    def _poison_outside_windows(self) -> None:
        table, bs = self.block_table_cpu.copy(), self.block_size
        flat = self.kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        for r, ctx in enumerate(self.context_lens):
            pos = np.arange(max(0, ctx - self.window + 1))  # below the first query's window
            slots = table[r, pos // bs].astype(np.int64) * bs + pos % bs
            flat[:, torch.from_numpy(slots).to(DEVICE)] = float("nan")
            table[r, : len(pos) // bs] = self.spare_block
        self.block_table = torch.from_numpy(table).to(DEVICE)

    def plan(self, **kwargs):
        return super().plan(sliding_window=self.window, **kwargs)

    def run(self, **plan_kwargs) -> torch.Tensor:
        n = self.num_actual_tokens
        reshape_and_cache(self.k[:n], self.v[:n], self.kv_cache, self.slot_mapping)
        out = torch.full_like(self.q[:n], float("nan"))
        kernels.paged_attention(
            self.q[:n], self.kv_cache, self.block_table, self.seq_lens_t, self.query_start_loc,
            self.scale, plan=self.plan(**plan_kwargs), out=out, logits_soft_cap=self.soft_cap,
        )  # fmt: skip
        return out

    def reference(self) -> torch.Tensor:
        outs = []
        for r, (ctx, q0) in enumerate(zip(self.context_lens, self.qsl_cpu)):
            q = self.q[q0 : self.qsl_cpu[r + 1]].cpu()
            ref = reference_attention(
                q, self.keys[r], self.values[r], ctx, self.scale, self.window, self.soft_cap
            )
            outs.append(ref)
        return torch.cat(outs)


# (query_lens, context_lens): decodes before and past the window, a long prompt in several
# prefill tiles, chunks after contexts shorter and longer than the window
KERNEL_SCENARIOS = {
    "decode": ([1, 1, 1, 1], [37, 5, 200, 90]),
    "prefill": ([150, 19], [0, 0]),
    "mixed": ([1, 24, 1, 13, 40], [170, 0, 3, 30, 77]),
}


@interpreter_rows_past_query
@pytest.mark.parametrize("scenario", list(KERNEL_SCENARIOS))
@pytest.mark.parametrize(
    "window,soft_cap,num_heads,num_kv_heads,dtype",
    [
        (1, None, 4, 2, torch.float32),  # each query sees only itself
        (40, 3.0, 8, 2, torch.float32),  # window edges inside key steps; soft-cap
        (64, None, 2, 2, torch.float16),  # a window of exactly one prefill key step
        (100, 3.0, 4, 4, torch.float16),
    ],
)
def test_kernel_window_and_soft_cap(scenario, window, soft_cap, num_heads, num_kv_heads, dtype):
    query_lens, context_lens = KERNEL_SCENARIOS[scenario]
    batch = WindowBatch(query_lens, context_lens, num_heads, num_kv_heads, 32, 16, dtype,
                        window=window, soft_cap=soft_cap, seed=window)  # fmt: skip
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize("num_splits", [None, 3, 8])
def test_kernel_window_split_kv(num_splits):
    # long contexts, few requests: split-KV segments over the window's keys only
    batch = WindowBatch([1, 1, 2], [1100, 700, 500], 8, 2, 32, 16, torch.float32,
                        window=300, soft_cap=4.0, seed=4)  # fmt: skip
    if num_splits is None:  # the heuristic, counting only the window's keys
        (launch,) = batch.plan().launches
        assert launch.num_splits == 1  # at most 303 keys a tile: too few to split
        assert Batch.plan(batch).launches[0].num_splits == 4  # 1100 keys without the window
    assert_close(batch.run(num_splits=num_splits), batch.reference(), torch.float32)


def test_kernel_skips_key_steps_below_the_window(monkeypatch):
    """The kernel's walk starts at the step holding the tile's first visible key."""
    visited: list[tuple[int, int]] = []  # (first key of a step, one past the last key)
    attend_block = kernels._attend_block

    def recording(*args, **kwargs):
        visited.append((int(args[5]), int(args[6])))  # start, kv_end
        return attend_block(*args, **kwargs)

    monkeypatch.setattr(kernels, "_attend_block", recording)
    batch = WindowBatch([1, 1], [1000, 20], 2, 2, 32, 16, torch.float32, window=100, seed=2)
    assert_close(batch.run(), batch.reference(), torch.float32)
    steps = sorted({start for start, kv_end in visited if kv_end == 1001})
    assert steps == list(range(896, 1001, 32))  # keys 901 .. 1000, in steps of 32
    assert sorted({start for start, kv_end in visited if kv_end == 21}) == [0]


def test_triton_backend_window_and_global_layers_share_a_step():
    """Gemma-style: a windowed and a global layer over one step's metadata, each with its
    own plan."""
    batch = WindowBatch([1, 70, 1], [300, 8, 0], 8, 2, 32, 16, torch.float32, window=50,
                        poison=False, seed=5)  # fmt: skip
    metadata = TritonAttentionBackend.build_metadata(batch.common())
    windowed = TritonAttentionBackend(8, 2, 32, batch.scale, sliding_window=50)
    out = windowed.forward(batch.q, batch.k, batch.v, batch.kv_cache, metadata)
    assert_close(out, batch.reference(), torch.float32)
    out = TritonAttentionBackend(8, 2, 32, batch.scale).forward(
        batch.q, batch.k, batch.v, batch.kv_cache, metadata
    )
    assert_close(out, Batch.reference(batch), torch.float32)
    assert {key[-1] for key in metadata._plans} == {50, None}
