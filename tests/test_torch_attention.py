"""The torch attention backend against a naive per-request softmax reference.

CPU decodes take either path (`decode_path`): the C++ kernel that reads the paged cache in
place (`pagellm.attention.cpu_decode`), or the gather of their K/V into SDPA.

Each case builds a flat batch of requests (decodes and prefill chunks, some after a cached
context, in a random order) over random non-contiguous blocks of a NaN-poisoned cache: the
context K/V are written at their slots first, every other slot stays NaN, so reading a slot
a request does not own turns its output into NaN.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pagellm.attention import cpu_decode
from pagellm.attention.base import CommonAttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(params=["in_place", "gather"])
def decode_path(request, monkeypatch) -> str:
    """CPU decodes through the in-place kernel, or gathered for SDPA."""
    in_place = request.param == "in_place"
    if in_place and cpu_decode.kernel() is None:
        pytest.skip("no C++ compiler here: the in-place decode kernel was not built")
    monkeypatch.setattr(TorchAttentionBackend, "in_place", in_place)
    return request.param


def _reference(q, k, v, context_len: int, scale: float) -> torch.Tensor:
    # q: [ql, H, D]; k, v: [seq_len, H_kv, D] (context then query tokens) -> [ql, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class _Case:
    """A random batch: per request (query_len, context_len), tensors, cache and metadata."""

    def __init__(self, reqs, heads, kv_heads, head_dim, block_size, seed, pad=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.reqs, self.heads, self.kv_heads, self.head_dim = reqs, heads, kv_heads, head_dim
        seq_lens = [q + c for q, c in reqs]
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 3  # spare blocks stay poisoned
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.tables = [[ids.pop() for _ in range(n)] for n in blocks_per_req]
        self.kv = [torch.randn(2, s, kv_heads, head_dim, generator=gen) for s in seq_lens]
        self.q = [torch.randn(q, heads, head_dim, generator=gen) for q, _ in reqs]
        shape = TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
        self.cache = torch.full(shape, float("nan"))
        self.block_size, self.pad = block_size, pad
        for r, (_, ctx) in enumerate(reqs):
            self._write(r, range(ctx))

    def slot(self, r: int, pos: int) -> int:
        return self.tables[r][pos // self.block_size] * self.block_size + pos % self.block_size

    def _write(self, r: int, positions) -> None:
        flat = self.cache.view(2, -1, self.kv_heads, self.head_dim)
        for p in positions:
            flat[:, self.slot(r, p)] = self.kv[r][:, p]

    def inputs(self):
        """Flat q, k, v (plus `pad` padding rows) and the step's common metadata."""
        q = torch.cat(self.q)
        k = torch.cat([kv[0, c:] for kv, (_, c) in zip(self.kv, self.reqs)])
        v = torch.cat([kv[1, c:] for kv, (_, c) in zip(self.kv, self.reqs)])
        if self.pad:
            q, k, v = (torch.cat([x, torch.randn(self.pad, *x.shape[1:])]) for x in (q, k, v))
        return q, k, v, self._common()

    def _common(self) -> CommonAttentionMetadata:
        query_lens = [q for q, _ in self.reqs]
        seq_lens = np.array([q + c for q, c in self.reqs], dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        width = max(len(t) for t in self.tables) + 2
        table = torch.zeros(len(self.reqs), width, dtype=torch.int32)  # padding: block 0
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

    def expected(self, scale: float) -> torch.Tensor:
        outs = [
            _reference(q, kv[0], kv[1], c, scale)
            for q, kv, (_, c) in zip(self.q, self.kv, self.reqs)
        ]
        return torch.cat(outs)


def _run(case: _Case) -> torch.Tensor:
    backend = TorchAttentionBackend(case.heads, case.kv_heads, case.head_dim, case.head_dim**-0.5)
    q, k, v, common = case.inputs()
    metadata = TorchAttentionBackend.build_metadata(common)
    return backend.forward(q, k, v, case.cache, metadata)


def _check(case: _Case) -> None:
    out = _run(case)
    n = sum(q for q, _ in case.reqs)
    torch.testing.assert_close(out[:n], case.expected(case.head_dim**-0.5), atol=1e-5, rtol=1e-5)
    assert torch.all(out[n:] == 0)  # padding rows
    # this step's K/V landed at their slots
    flat = case.cache.view(2, -1, case.kv_heads, case.head_dim)
    for r, (q, c) in enumerate(case.reqs):
        for p in (c, c + q - 1):
            assert torch.equal(flat[:, case.slot(r, p)], case.kv[r][:, p])


MIXES = {
    "decodes": [(1, 7), (1, 1), (1, 30), (1, 16), (1, 0)],
    "prefills": [(9, 0), (3, 0), (17, 0)],
    "prefills_after_context": [(5, 11), (8, 8), (2, 30)],
    "mixed": [(6, 0), (1, 12), (4, 9), (1, 3), (1, 0), (13, 0), (1, 40), (3, 5)],
}


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_reference(block_size, mix, heads, kv_heads, decode_path):
    reqs = list(MIXES[mix])
    random.Random(block_size).shuffle(reqs)  # decodes are not first
    _check(_Case(reqs, heads, kv_heads, 16, block_size, seed=block_size + heads))


def test_padded_rows_are_zero(decode_path):
    _check(_Case([(1, 5), (4, 3), (1, 9)], 4, 2, 8, 4, seed=3, pad=5))


def test_decodes_between_prefills(decode_path):
    # decode rows not contiguous: prefill, decode, prefill, decode
    _check(_Case([(5, 0), (1, 6), (3, 4), (1, 2)], 8, 2, 16, 4, seed=5))


def test_random_batches(decode_path):
    rng = random.Random(0)
    for seed in range(10):
        reqs = [(rng.choice([1, 1, 2, rng.randint(2, 20)]), rng.randint(0, 40)) for _ in range(6)]
        reqs = [(q, c) for q, c in reqs if q + c > 0]
        heads, kv_heads = rng.choice([(4, 1), (4, 2), (9, 3)])
        _check(_Case(reqs, heads, kv_heads, 8, rng.choice([1, 4, 16]), seed=seed))


def test_metadata_decode_groups(monkeypatch):
    """Decodes are sorted longest first and grouped under the padded-key budget."""
    from pagellm.attention import torch_backend

    case = _Case([(1, 3), (5, 0), (1, 9), (1, 4), (1, 8)], 2, 2, 8, 4, seed=0)
    md = TorchAttentionBackend.build_metadata(case.inputs()[3])
    assert [g.rows.tolist() for g in md.decodes] == [[6, 8, 7, 0]]  # seq_lens 10, 9, 5, 4
    assert md.decodes[0].slots.shape == (4, 10)
    assert [(p.start, p.end, p.slots) for p in md.prefills] == [(1, 6, None)]
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_TOKENS", 20)  # 2 rows of 10, then 4 of 5
    md = TorchAttentionBackend.build_metadata(case.inputs()[3])
    assert [g.rows.tolist() for g in md.decodes] == [[6, 8], [7, 0]]
    assert [tuple(g.slots.shape) for g in md.decodes] == [(2, 10), (2, 5)]
    assert md.decodes[1].mask[:, 0, 0].tolist() == [[True] * 5, [True] * 4 + [False]]
    bias = md.decodes[1].bias(torch.float32)  # SDPA's additive form, made once per step
    assert bias[:, 0, 0].tolist() == [[0.0] * 5, [0.0] * 4 + [float("-inf")]]
    assert md.decodes[1].bias(torch.float32) is bias


def test_decodes_in_groups(monkeypatch):
    """Decodes attended a few requests at a time (a small group budget) give the same output."""
    from pagellm.attention import torch_backend

    monkeypatch.setattr(TorchAttentionBackend, "in_place", False)
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_TOKENS", 50)
    _check(_Case([(1, 7), (3, 0), (1, 30), (1, 39), (1, 0), (1, 12)], 4, 2, 8, 4, seed=9))


def test_in_place_decodes_read_no_slot_outside_their_blocks(monkeypatch):
    """Long contexts over many pages of one token and of 16 (block boundaries everywhere),
    bf16 and fp8 caches: the kernel against the gather path on the same cache."""
    if cpu_decode.kernel() is None:
        pytest.skip("no C++ compiler here: the in-place decode kernel was not built")
    for block_size, dtype in ((1, torch.bfloat16), (16, torch.float8_e4m3fn)):
        case = _Case([(1, 300), (1, 17), (1, 16), (1, 15), (1, 0)], 12, 4, 64, block_size, 4)
        q, k, v, common = case.inputs()
        outs = []
        for in_place in (True, False):
            monkeypatch.setattr(TorchAttentionBackend, "in_place", in_place)
            cache = case.cache.to(dtype)  # the NaN poison stays NaN
            backend = TorchAttentionBackend(12, 4, 64, 0.125)
            metadata = TorchAttentionBackend.build_metadata(common)
            q_in = q.to(torch.bfloat16) if dtype == torch.bfloat16 else q
            outs.append(backend.forward(q_in, k.to(q_in.dtype), v.to(q_in.dtype), cache, metadata))
        assert not outs[0].isnan().any()
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


# decodes whose key counts straddle the kernel's 16-key (AVX-512) and 8-key (AVX2) chunks
# (0, 6, 7, 14, 15, 16, 32, 100 cached + 1)
_CHUNK_EDGES = [(1, 0), (1, 6), (1, 7), (1, 14), (1, 15), (1, 16), (1, 32), (1, 100)]


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (9, 3), (16, 2), (10, 2)])
def test_vector_kernel_head_sizes(head_dim, heads, kv_heads, decode_path):
    """The kernel's vector paths (AVX-512: head_dim 64 / 128 / 256; AVX2 + FMA: 32 too;
    others run its scalar loop, which the small cases above test) against the reference,
    float32: query heads a KV head of 1, 3, 8 and 5 (values accumulated a few heads at a
    time, with a remainder)."""
    _check(_Case(list(_CHUNK_EDGES), heads, kv_heads, head_dim, 16, seed=head_dim + heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 5.0), (7, 2.0)])
def test_vector_kernel_windows_soft_caps_and_caches(dtype, window, soft_cap, monkeypatch):
    """head_dim 64 (the vector paths) with sliding windows, soft-caps and every cache kind,
    decodes and prefill rows (with and without context): the kernel against the gather path
    on the same cache."""
    _kernel_against_gather(dtype, 64, [*_CHUNK_EDGES, (1, 57), (19, 0), (9, 24)], window,
                           soft_cap, monkeypatch)  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_vector_kernel_bf16_head_sizes(head_dim, monkeypatch):
    """bf16 queries on a bf16 cache (vdpbf16ps where the CPU has AVX512-BF16: keys and values
    two at a time, odd counts included) at every vector head size."""
    _kernel_against_gather(torch.bfloat16, head_dim, [*_CHUNK_EDGES, (18, 0), (7, 16)], None,
                           None, monkeypatch)  # fmt: skip


def _kernel_against_gather(dtype, head_dim, reqs, window, soft_cap, monkeypatch) -> None:
    if cpu_decode.kernel() is None:
        pytest.skip("no C++ compiler here: the in-place decode kernel was not built")
    case = _Case(reqs, 12, 4, head_dim, 4, seed=11)
    q, k, v, common = case.inputs()
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q, k, v = q.to(q_dtype), k.to(q_dtype), v.to(q_dtype)
    outs = []
    for in_place in (True, False):
        monkeypatch.setattr(TorchAttentionBackend, "in_place", in_place)
        backend = TorchAttentionBackend(
            12, 4, head_dim, head_dim**-0.5, sliding_window=window, logits_soft_cap=soft_cap
        )
        metadata = TorchAttentionBackend.build_metadata(common)
        outs.append(backend.forward(q, k, v, case.cache.to(dtype), metadata))
    assert not outs[0].isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_without_a_working_compiler_decodes_take_the_gather_path(monkeypatch, broken_compiler):
    """No C++ compiler on PATH, or one that fails: no kernel, and the backend still decodes."""
    monkeypatch.setattr(TorchAttentionBackend, "in_place", True)
    cpu_decode.kernel.cache_clear()
    try:
        assert cpu_decode.kernel() is None
        _check(_Case([(1, 5), (4, 3), (1, 9)], 4, 2, 8, 4, seed=3))
    finally:
        cpu_decode.kernel.cache_clear()  # the next user builds (or finds) the real kernel


def test_every_cache_kind_decodes_in_place(monkeypatch):
    """CPU attention of float32 and bf16 queries reads the cache in place, whatever its kind
    (float32, bf16 and fp8 alike); `in_place = False` sends it to the gather path."""
    if cpu_decode.kernel() is None:
        pytest.skip("no C++ compiler here: the in-place decode kernel was not built")
    backend = TorchAttentionBackend(4, 2, 8, 0.125)
    q32, q16 = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    assert backend._in_place(q32) and backend._in_place(q16)
    monkeypatch.setattr(TorchAttentionBackend, "in_place", False)
    assert not backend._in_place(q16)


def test_kernel_rejects_bad_arguments():
    """The in-place kernel's wrapper: a wrong layout, dtype or row list is a ValueError, on
    the first call of a layout and on later calls of one already checked."""
    if cpu_decode.kernel() is None:
        pytest.skip("no C++ compiler here")
    q = torch.randn(3, 4, 16)
    out = torch.empty_like(q)
    cache = torch.zeros(4, 8, 2, 16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    rows, reqs = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    lens = torch.tensor([1, 2, 3], dtype=torch.int32)
    args = (cache, cache, table, rows, reqs, lens, 0.25)
    cpu_decode.paged_attention(out, q, *args)  # the layout, now checked
    bad = [
        ((out, q, cache, cache, table.long(), rows, reqs, lens, 0.25), "block_table"),
        ((out, q, cache, cache[..., :8], table, rows, reqs, lens, 0.25), "alike"),
        ((out.bfloat16(), q, *args), "q and out"),
        ((out[:2], q, *args), "same rows"),
        ((out, q, cache, cache, table, rows.int(), reqs, lens, 0.25), "int64"),
        ((out, q, cache, cache, table, rows, reqs[:2], lens, 0.25), "one length"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            cpu_decode.paged_attention(*call)
