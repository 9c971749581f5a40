"""Triton kernels (reshape_and_cache, paged attention) against a naive torch reference.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set here before Triton is imported), so shapes stay small; realistic bf16 shapes carry the
`gpu` marker. The interpreter's `tl.dot` is wrong for bf16 (numpy has no bf16), so CPU runs
cover fp32 and fp16 and the GPU runs add bf16.

Every test poisons what the kernels must not touch: the output starts as NaN (catches rows
never written) and every cache slot no block table references, plus the unused tail of each
request's last page and of each block-table row, holds NaN (catches out-of-bounds reads).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, a TypeError since numpy 2.4
    (triton-lang/triton#9171, fixed after 3.6.0): loops with loaded bounds need this."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "_pagellm_fixed", False):
        return

    def fixed(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    fixed._pagellm_fixed = True
    interpreter._patch_lang_tensor = fixed


def _patch_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter rounds to fp8 without carrying into the exponent (7.93 ->
    4.0 in e4m3, not 8.0); GPUs round correctly. Downcasts to fp8 go through torch here."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    to_fp8 = builder.create_fp_to_fp
    if getattr(to_fp8, "_pagellm_fixed", False):
        return
    torch_fp8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}

    def fixed(self, src, dst_type, rounding_mode):
        dst = torch_fp8.get(dst_type.scalar.name)
        if dst is None or src.dtype.scalar.primitive_bitwidth <= 8:
            return to_fp8(self, src, dst_type, rounding_mode)
        x = torch.from_numpy(np.asarray(src.data, dtype=np.float32))
        return interpreter.TensorHandle(x.to(dst).view(torch.uint8).numpy(), dst_type.scalar)

    fixed._pagellm_fixed = True
    builder.create_fp_to_fp = fixed


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_for_numpy_2_4()
    _patch_interpreter_fp8_rounding()

from pagellm.attention.base import CommonAttentionMetadata  # noqa: E402
from pagellm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagellm.kernels.attention_plan import (  # noqa: E402
    choose_num_splits,
    decode_config,
    plan_attention,
)
from pagellm.kernels.paged_attention import paged_attention  # noqa: E402
from pagellm.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    from triton.runtime.interpreter import InterpretedFunction

    from pagellm.kernels import paged_attention as _kernels

    assert isinstance(_kernels._paged_attention_kernel, InterpretedFunction), (
        "pagellm.kernels was imported before TRITON_INTERPRET=1 was set (by another test "
        "module?); run with TRITON_INTERPRET=1 in the environment"
    )
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Batch:
    """A step's inputs: cached contexts in a NaN-poisoned paged cache, new q/k/v, metadata."""

    def __init__(
        self,
        query_lens: list[int],
        context_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        num_padding: int = 0,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.query_lens, self.context_lens = query_lens, context_lens
        self.seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        num_reqs, num_tokens = len(query_lens), sum(query_lens)

        # full K/V of every request: [seq_len, num_kv_heads, head_dim] (the ground truth)
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype)

        self.keys = [randn(n, num_kv_heads, head_dim) for n in self.seq_lens]
        self.values = [randn(n, num_kv_heads, head_dim) for n in self.seq_lens]
        self.q = randn(num_tokens + num_padding, num_heads, head_dim).to(DEVICE)
        # new tokens' K/V in the flat batch, padded rows at the end
        self.k = torch.cat([k[c:] for k, c in zip(self.keys, context_lens)] + [
            randn(num_padding, num_kv_heads, head_dim)
        ]).to(DEVICE)  # fmt: skip
        self.v = torch.cat([v[c:] for v, c in zip(self.values, context_lens)] + [
            randn(num_padding, num_kv_heads, head_dim)
        ]).to(DEVICE)  # fmt: skip

        blocks_per_req = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(blocks_per_req) + 3  # 3 blocks no table references
        perm = rng.permutation(num_blocks)
        self.spare_block = int(perm[-1])
        max_blocks = max(blocks_per_req) + 1
        table = np.full((num_reqs, max_blocks), self.spare_block, dtype=np.int32)
        used = 0
        for r, nb in enumerate(blocks_per_req):
            table[r, :nb] = perm[used : used + nb]
            used += nb
        self.block_table_cpu = table
        self.kv_cache = torch.full(
            (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )
        slots = []
        for r in range(num_reqs):
            pos = np.arange(self.seq_lens[r])
            slot = table[r, pos // block_size].astype(np.int64) * block_size + pos % block_size
            ctx = context_lens[r]
            flat = self.kv_cache.view(2, -1, num_kv_heads, head_dim)
            flat[0, slot[:ctx]] = self.keys[r][:ctx]
            flat[1, slot[:ctx]] = self.values[r][:ctx]
            slots.append(slot[ctx:])
        self.kv_cache = self.kv_cache.to(DEVICE)
        self.slot_mapping = torch.from_numpy(np.concatenate(slots)).to(DEVICE)
        self.qsl_cpu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        self.seq_lens_cpu = np.array(self.seq_lens, dtype=np.int32)
        self.query_start_loc = torch.from_numpy(self.qsl_cpu).to(DEVICE)
        self.seq_lens_t = torch.from_numpy(self.seq_lens_cpu).to(DEVICE)
        self.block_table = torch.from_numpy(table).to(DEVICE)
        self.scale = head_dim**-0.5

    @property
    def num_actual_tokens(self) -> int:
        return int(self.qsl_cpu[-1])

    def common(self) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=len(self.query_lens),
            block_size=self.block_size,
            num_actual_tokens=self.num_actual_tokens,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens_t,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            query_start_loc_cpu=self.qsl_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
        )

    def plan(self, **kwargs):
        return plan_attention(
            self.qsl_cpu,
            self.seq_lens_cpu,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            DEVICE,
            element_size=self.dtype.itemsize,
            **kwargs,
        )

    def run(self, **plan_kwargs) -> torch.Tensor:
        """reshape_and_cache, then paged_attention into a NaN-filled output."""
        n = self.num_actual_tokens
        reshape_and_cache(self.k[:n], self.v[:n], self.kv_cache, self.slot_mapping)
        q = self.q[:n]
        out = torch.full_like(q, float("nan"))
        paged_attention(
            q,
            self.kv_cache,
            self.block_table,
            self.seq_lens_t,
            self.query_start_loc,
            self.scale,
            plan=self.plan(**plan_kwargs),
            out=out,
        )
        return out

    def reference(self) -> torch.Tensor:
        """Per request: causal softmax attention in fp32 over the ground-truth K/V."""
        group = self.num_heads // self.num_kv_heads
        outs = []
        for r, (ql, ctx) in enumerate(zip(self.query_lens, self.context_lens)):
            q = self.q[self.qsl_cpu[r] : self.qsl_cpu[r + 1]].float()  # [ql, H, D]
            k = self.keys[r].to(DEVICE).float().repeat_interleave(group, dim=1)  # [L, H, D]
            v = self.values[r].to(DEVICE).float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            keys = torch.arange(ctx + ql, device=DEVICE)
            visible = keys[None, :] <= (ctx + torch.arange(ql, device=DEVICE))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))  # [H, ql, L]
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).cpu())
        return torch.cat(outs)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.float().cpu()
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements never written"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 32, 32)])
def test_reshape_and_cache(dtype, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(1)
    num_tokens, num_blocks = 20, 6
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    # a strided value, as from a fused qkv projection
    value = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    value = value.to(DEVICE)[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[3, 11]] = -1  # padded tokens
    slot_mapping = slots.to(DEVICE)
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    ).to(DEVICE)
    reshape_and_cache(key, value, cache, slot_mapping)

    flat = cache.view(2, -1, num_kv_heads, head_dim).cpu()
    kept = slots >= 0
    assert torch.equal(flat[0, slots[kept]], key.cpu()[kept])
    assert torch.equal(flat[1, slots[kept]], value.cpu()[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert flat[:, untouched].isnan().all()


def test_reshape_and_cache_rejects_bad_inputs():
    key = torch.zeros(4, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be"):
        reshape_and_cache(key, key, cache[:, :, :, :1], slots)
    with pytest.raises(TypeError, match="share a dtype"):
        reshape_and_cache(key, key, cache.half(), slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        reshape_and_cache(key, key, cache, slots.float())
    with pytest.raises(ValueError, match="stride"):
        reshape_and_cache(key.transpose(1, 2).contiguous().transpose(1, 2), key, cache, slots)
    with pytest.raises(ValueError, match="only 4 tokens"):
        reshape_and_cache(key, key, cache, torch.arange(5, device=DEVICE))


# ---------------------------------------------------------------- paged attention

# (query_lens, context_lens) per scenario
# (contexts past 2 * 64 keys: several steps in both the unmasked and the causal loop)
SCENARIOS = {
    "decode": ([1, 1, 1], [37, 5, 200]),
    "prefill": ([19, 140], [0, 0]),
    "prefill_prefix": ([21, 9], [150, 17]),
    "mixed": ([1, 24, 1, 13], [170, 0, 3, 30]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"]
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention(scenario, num_heads, num_kv_heads, head_dim, block_size):
    dtype = torch.float32 if block_size == 16 else torch.float16
    query_lens, context_lens = SCENARIOS[scenario]
    batch = Batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [(9, 3, 16), (32, 1, 16), (4, 4, 64)],
    ids=["gqa3", "gqa32", "page64"],
)
def test_paged_attention_odd_layouts(num_heads, num_kv_heads, block_size):
    # a group that is not a power of two (SmolLM2: 9/3), one larger than a program takes
    # (several programs per KV head), and pages longer than a key step
    query_lens, context_lens = SCENARIOS["mixed"]
    batch = Batch(query_lens, context_lens, num_heads, num_kv_heads, 32, block_size, torch.float32)
    assert_close(batch.run(), batch.reference(), torch.float32)


def test_plan_decode_only_needs_no_tile_map():
    batch = Batch([1] * 5, [3, 9, 0, 40, 2], 8, 2, 64, 16, torch.float32)
    (launch,) = batch.plan().launches
    assert launch.tile_req is None and launch.num_tiles == 5 and launch.num_splits == 1


def test_plan_prefill_tiles_cover_every_query_once_heaviest_first():
    query_lens, context_lens = [1, 300, 2, 130, 1], [10, 0, 7, 500, 20]
    batch = Batch(query_lens, context_lens, 4, 4, 32, 16, torch.float32)
    decode, prefill = batch.plan().launches
    assert decode.tile_req.tolist() == [4, 0, 2] and decode.tile_q.tolist() == [0, 0, 0]
    block_q = prefill.config.block_q
    covered = sorted(
        (r, q)
        for r, q0 in zip(prefill.tile_req.tolist(), prefill.tile_q.tolist())
        for q in range(q0, min(q0 + block_q, query_lens[r]))
    )
    assert covered == [(r, q) for r in (1, 3) for q in range(query_lens[r])]
    work = [
        context_lens[r] + min(q0 + block_q, query_lens[r])
        for r, q0 in zip(prefill.tile_req.tolist(), prefill.tile_q.tolist())
    ]
    assert work == sorted(work, reverse=True)


def test_choose_num_splits():
    assert choose_num_splits(64 * 8, 4096, 132) == 1  # batch 64, 8 KV heads: enough programs
    assert choose_num_splits(2 * 8, 32768, 132) == 17  # fill two waves of 132 SMs
    assert choose_num_splits(2 * 8, 1024, 132) == 4  # but keep >= MIN_KEYS_PER_SPLIT keys each
    assert choose_num_splits(1, 10**6, 132) == 64  # capped


def test_split_kv_long_context_decode():
    # few sequences, long contexts: the planner must take the split-KV path
    batch = Batch([1, 1], [1100, 700], 8, 2, 64, 16, torch.float32, seed=3)
    plan = batch.plan()
    assert [launch.num_splits > 1 for launch in plan.launches] == [True]
    assert_close(batch.run(), batch.reference(), torch.float32)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_kv_forced_with_short_queries(num_splits):
    # speculative-decode-like queries (several rows per tile) next to a prefill chunk; 8
    # splits leaves some segments empty, and with context 126 the last segment starts at
    # key 128, past what the first two queries may see
    group = 4
    queries = decode_config(group, 64).block_q
    batch = Batch([queries, 1, 20, queries], [90, 30, 10, 126], 8, 2, 64, 16, torch.float32)
    plan = batch.plan(num_splits=num_splits)
    assert [launch.num_splits for launch in plan.launches] == [num_splits, 1]
    assert_close(batch.run(num_splits=num_splits), batch.reference(), torch.float32)


def test_backend_forward_with_padding():
    batch = Batch([1, 17, 1], [40, 8, 0], 8, 2, 64, 16, torch.float32, num_padding=3, seed=5)
    pad = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    batch.slot_mapping = torch.cat([batch.slot_mapping, pad])
    common = batch.common()
    backend = TritonAttentionBackend(8, 2, 64, batch.scale)
    metadata = TritonAttentionBackend.build_metadata(common)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, metadata)
    n = batch.num_actual_tokens
    assert out.shape == batch.q.shape
    assert torch.equal(out[n:].cpu(), torch.zeros_like(out[n:]).cpu())
    assert_close(out[:n], batch.reference(), torch.float32)
    assert len(metadata._plans) == 1  # a second layer reuses the plan
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, metadata)
    assert len(metadata._plans) == 1


def test_backend_decode_step_runs_longest_requests_first():
    """A decode-only step gets a device-built tile map, longest first; the output is the
    same attention."""
    context_lens = [5, 100, 7, 100, 0, 30]
    batch = Batch([1] * 6, context_lens, 8, 2, 64, 16, torch.float32, seed=7)
    metadata = TritonAttentionBackend.build_metadata(batch.common())
    backend = TritonAttentionBackend(8, 2, 64, batch.scale)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, metadata)
    assert_close(out, batch.reference(), torch.float32)
    ((launch,),) = [plan.launches for plan in metadata._plans.values()]
    order = launch.tile_req.tolist()
    assert sorted(order) == list(range(6)) and launch.tile_q.tolist() == [0] * 6
    assert [context_lens[r] for r in order] == sorted(context_lens, reverse=True)


def test_paged_attention_rejects_bad_inputs():
    batch = Batch([1], [3], 4, 2, 64, 16, torch.float32)
    plan = batch.plan()
    args = (batch.kv_cache, batch.block_table, batch.seq_lens_t, batch.query_start_loc, 1.0)
    with pytest.raises(TypeError, match="block_table must be int32"):
        paged_attention(batch.q, batch.kv_cache, batch.block_table.long(), *args[2:], plan=plan)
    with pytest.raises(ValueError, match="num_heads % num_kv_heads"):
        paged_attention(batch.q[:, :3], *args, plan=plan)
    with pytest.raises(ValueError, match="head layout"):
        paged_attention(batch.q[:, :2], *args, plan=plan)


# ---------------------------------------------------------------- realistic shapes, GPU


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1] * 64, [2047] * 64),  # decode batch
        ([1] * 2, [16383, 9000]),  # long-context decode: split-KV
        ([2048], [0]),  # prefill
        ([512, 1, 1, 300] + [1] * 28, [1536, 4000, 100, 0] + [700] * 28),  # mixed
    ],
)
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_attention_gpu(dtype, query_lens, context_lens, block_size):
    batch = Batch(query_lens, context_lens, 32, 8, 128, block_size, dtype, seed=7)
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_paged_attention_gpu_mha_head_dim_64():
    batch = Batch([1000, 1, 64], [24, 3000, 64], 16, 16, 64, 16, torch.bfloat16, seed=8)
    assert_close(batch.run(), batch.reference(), torch.bfloat16)
