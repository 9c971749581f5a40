"""Sliding-window attention, logit soft-capping and custom scales.

- the torch backend, in both its CPU paths (every row through the C++ in-place kernel, or its
  own masks over gathered keys for SDPA), and the paged Triton kernel (under Triton's
  interpreter on CPU) against a naive reference, with every cache slot outside all of a
  request's windows NaN-poisoned (a read of one shows up as NaN in the output);
- a windowed Mistral's logits equal HF's through either CPU path and both of the kernel's
  loops (scalar, vector): chunked prefill and decodes across the window's edge;
- the KV blocks freed outside the window, and which layers are windowed, per family;
- the engine's greedy ids equal HF's, blocks outside the window freed (Mistral: in either CPU
  path).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from model_utils import TINY_CONFIG, hf_logits, load_our_model, make_tiny_hf_model, run_paged
from test_kernels import DEVICE, Batch, assert_close  # first: sets TRITON_INTERPRET=1 on CPU
from test_kv_cache_manager import BLOCK_SIZE, admit, free_ids, make_request
from test_torch_attention import _Case as TorchCase
from test_torch_attention import decode_path  # noqa: F401 (the fixture: C++ kernel or SDPA)

from pagellm import LLM, SamplingParams
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_backend import TritonAttentionBackend
from pagellm.core.kv_cache_manager import KVCacheManager
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


class WindowCase(TorchCase):
    """test_torch_attention's flat batch over a NaN cache, with the context positions no
    query of their request may see (before the first query's window) NaN too."""

    def __init__(self, reqs, heads, kv_heads, head_dim, block_size, window, seed):
        super().__init__(reqs, heads, kv_heads, head_dim, block_size, seed)
        self.window = window
        flat = self.cache.view(2, -1, kv_heads, head_dim)
        for r, (_, ctx) in enumerate(reqs):
            for p in range(0 if window is None else max(0, ctx - window + 1)):
                flat[:, self.slot(r, p)] = float("nan")

    def expected(self, scale: float, soft_cap: float | None = None) -> torch.Tensor:
        return torch.cat([
            reference_attention(q, kv[0], kv[1], c, scale, self.window, soft_cap)
            for q, kv, (_, c) in zip(self.q, self.kv, self.reqs)
        ])  # fmt: skip


# (query_len, context_len): prompts longer than the window, chunks after a context shorter
# and longer than the window, decodes before and past it
WINDOW_MIX = [(1, 3), (20, 0), (1, 30), (6, 4), (9, 25), (1, 7), (3, 0), (1, 11), (12, 40)]


# 51: the longest request (52 keys) has exactly one key outside its window
@pytest.mark.parametrize("window", [1, 5, 8, 51, 64])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (8, 2, 1), (6, 1, 16)])
@pytest.mark.usefixtures("decode_path")
def test_torch_backend_window_and_soft_cap(window, soft_cap, heads, kv_heads, block_size):
    reqs = list(WINDOW_MIX)
    random.Random(window).shuffle(reqs)
    case = WindowCase(reqs, heads, kv_heads, 16, block_size, window, seed=window + heads)
    scale = 0.37  # not head_dim ** -0.5: the scale is the layer's
    backend = TorchAttentionBackend(
        heads, kv_heads, 16, scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    q, k, v, common = case.inputs()
    metadata = TorchAttentionBackend.build_metadata(common)
    out = backend.forward(q, k, v, case.cache, metadata)
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
        q, k, v, common = case.inputs()
        metadata = TorchAttentionBackend.build_metadata(common)
        outs.append(backend.forward(q, k, v, case.cache, metadata))
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


@pytest.mark.skipif(DEVICE == "cuda", reason="records the interpreter's calls")
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


# ---------------------------------------------------------------- KV blocks outside the window


def window_manager(num_blocks: int = 11, window: int = 6) -> KVCacheManager:
    return KVCacheManager(BLOCK_SIZE, num_blocks, max_model_len=64, sliding_window=window)


def decode(manager: KVCacheManager, request, token: int) -> list[int] | None:
    """One decode step as the scheduler runs it: allocate, then count the token computed."""
    request.append_output_token(token)
    new_ids = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    return new_ids


def test_blocks_before_the_window_are_freed_as_the_request_grows():
    manager = window_manager()  # blocks of 4 tokens, window 6
    a = make_request("a", list(range(8)))
    assert admit(manager, a) == (0, [1, 2])
    assert decode(manager, a, 100) == [3]  # position 8 sees keys 3..8: block 1 stays
    assert manager.get_block_ids("a") == [1, 2, 3]
    # position 9 sees keys 4..9: block 1 (positions 0..3) is never read again
    assert decode(manager, a, 101) == []
    assert manager.get_block_ids("a") == [0, 2, 3]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 1] and manager.num_free_blocks == 8
    assert [decode(manager, a, t) for t in (102, 103, 104)] == [[], [], [4]]  # 10, 11, 12
    assert decode(manager, a, 105) == [] and manager.get_block_ids("a") == [0, 0, 3, 4]  # 13
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 1, 2]
    manager.free(a)  # the null block is not freed
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 1, 2, 4, 3]
    assert manager.block_pool.null_block.ref_cnt == 0 and manager.usage == 0.0


def test_chunked_prefill_frees_before_each_chunk():
    manager = window_manager(window=5)
    a = make_request("a", list(range(24)))
    assert manager.allocate_slots(a, 8) == [1, 2]
    a.num_computed_tokens = 8
    # the chunk 8..15: its first query (8) sees keys 4..8, so block 1 goes
    assert manager.allocate_slots(a, 8) == [3, 4]
    a.num_computed_tokens = 16
    assert manager.get_block_ids("a") == [0, 2, 3, 4]
    # the chunk 16..23 sees keys from 12 on: blocks 2 and 3 go (after the front blocks)
    assert manager.allocate_slots(a, 8) == [5, 6]
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5, 6]
    assert free_ids(manager) == [7, 8, 9, 10, 1, 3, 2]


def test_global_layers_keep_every_block():
    manager = KVCacheManager(BLOCK_SIZE, 11, max_model_len=64, sliding_window=None)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    for token in range(6):
        decode(manager, a, token)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]


def test_prefix_hit_stops_where_window_blocks_are_gone():
    manager = window_manager(num_blocks=8)
    a = make_request("a", list(range(16)))
    admit(manager, a)
    manager.free(a)  # cached: 1..4 hold positions 0..15
    assert free_ids(manager) == [5, 6, 7, 4, 3, 2, 1]
    other = make_request("x", list(range(100, 120)))
    assert admit(manager, other) == (0, [5, 6, 7, 4, 3])  # evicts positions 8..15
    manager.free(other)
    b = make_request("b", list(range(16)) + [50, 51])
    # a hit past position 8 would need keys from 8 on: the hit is 0..7, blocks 1 and 2
    hits, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 8 and [blk.block_id for blk in hits] == [1, 2]
    assert manager.allocate_slots(b, 10, hits) == [3, 4, 7]
    assert manager.get_block_ids("b") == [1, 2, 3, 4, 7]


def test_prefix_hit_after_the_head_was_evicted():
    """A request whose early blocks were freed (window) and then reused by another request
    still gives a hit: only the blocks inside the window of the hit's end are taken."""
    manager = window_manager(num_blocks=8)
    a = make_request("a", list(range(12)))
    assert admit(manager, a) == (0, [1, 2, 3])
    new_ids = [decode(manager, a, 200 + t) for t in range(8)]  # positions 12..19
    assert new_ids == [[4], [], [], [], [5], [], [], []]
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5]
    manager.free(a)
    assert free_ids(manager) == [6, 7, 1, 2, 3, 5, 4]  # freed early: 1, 2, 3 go first
    x = make_request("x", list(range(100, 116)))
    assert admit(manager, x) == (0, [6, 7, 1, 2])  # overwrites positions 0..7
    b = make_request("b", a.all_token_ids + [60])
    hits, num_computed = manager.get_computed_blocks(b)
    # a hit up to 20: position 20 sees keys 15..20, in blocks 4 and 5 (3 is not needed)
    assert num_computed == 20 and [blk.block_id for blk in hits] == [0, 0, 0, 4, 5]
    assert manager.allocate_slots(b, 1, hits) == [3]
    assert manager.get_block_ids("b") == [0, 0, 0, 4, 5, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 4, 5, 3)] == [0, 1, 1, 1]
    assert manager.num_free_blocks == 0 and (manager.prefix_cache_hits == 20)


# ---------------------------------------------------------------- which layers are windowed

MOE = dict(num_experts_per_tok=2, num_experts=4, moe_intermediate_size=32)
# (HF model_type, config overrides): our per-layer windows must be HF's
LAYER_WINDOW_CONFIGS = {
    "mistral": ("mistral", dict(sliding_window=8)),
    "mistral-none": ("mistral", dict(sliding_window=None)),
    "qwen2-upper": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen2-off": ("qwen2", dict(use_sliding_window=False, sliding_window=8)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mixtral": ("mixtral", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=3,
                                    shared_expert_intermediate_size=32, **MOE)),
    "qwen3_moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8, **MOE)),
    "gemma2": ("gemma2", dict(sliding_window=8)),
    "gemma3": ("gemma3_text", dict(sliding_window=8, sliding_window_pattern=3)),
    "phi3": ("phi3", dict(sliding_window=8, pad_token_id=0)),
    "olmo2-none": ("olmo2", dict()),
    "gpt_oss": ("gpt_oss", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss-all": ("gpt_oss", dict(sliding_window=8, layer_types=["sliding_attention"] * 4)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYER_WINDOW_CONFIGS))
def test_layer_windows_are_hfs(name):
    """Each layer's window as HF's attention modules take it (HF Mistral, Mixtral, Phi-3 read
    `config.sliding_window` in every layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagellm.models.registry import get_model_cls

    model_type, overrides = LAYER_WINDOW_CONFIGS[name]
    kwargs = {**TINY_CONFIG, "num_hidden_layers": 4, "head_dim": 16, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    reads_config = model_type in ("mistral", "mixtral", "phi3")  # the others set it per layer
    default = config.sliding_window if reads_config else None
    expected = [getattr(layer.self_attn, "sliding_window", default) for layer in hf.model.layers]
    expected = [w or None for w in expected]  # Qwen2-MoE's "no window" is 0
    ours = get_model_cls(type(hf).__name__).sliding_windows(config)
    assert list(ours) == expected
    assert name.endswith(("-none", "-off")) == (set(expected) == {None})


# ---------------------------------------------------------------- logits equal HF's

# all longer than the window; the first a key longer (its second chunk, and the step that
# holds it, reach exactly one key outside the window)
WINDOW_PROMPT_LENGTHS = (8, 16, 23)


@pytest.mark.parametrize("head_dim", [16, 64])  # the C++ kernel's scalar loop, a vector path
@pytest.mark.usefixtures("decode_path")
def test_windowed_logits_equal_hf(head_dim, tmp_path):
    """Mistral with a 7-token window: the logits of every prompt token (prefill chunks of 5,
    so chunks begin before, at and past the window's edge) and of 6 decodes past it, in
    staggered, shuffled batches that mix prefills and decodes, are HF's."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model("mistral", tmp_path, sliding_window=7, head_dim=head_dim, std=0.3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_our_model(folder)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in WINDOW_PROMPT_LENGTHS]
    runs = run_paged(ours, prompts, num_decode_steps=6, block_size=4, chunk_size=5,
                     stagger=True, shuffle=True)  # fmt: skip
    for tokens, logits in runs:
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- greedy ids equal HF's

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def window_prompts() -> list[list[int]]:
    """Prompts of 40-80 tokens; the last shares its first 56 tokens with the first (a prefix
    hit whose head may already be outside the window)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 41, 80)]
    return prompts + [prompts[0][:56] + torch.randint(3, 500, (9,), generator=gen).tolist()]


def assert_greedy_matches_hf(folder: str, prompts: list[list[int]], **engine_args) -> dict:
    """Our greedy ids (the engine in this process, to spare a start-up) against HF's."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with LLM(model=folder, dtype="float32", seed=0, **engine_args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32,
                               use_tqdm=False)  # fmt: skip
        stats = llm.llm_engine.call_utility("get_stats")
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
    return stats


@pytest.mark.usefixtures("decode_path")
def test_mistral_window_matches_hf_in_a_cache_only_window_blocks_fit(tmp_path, monkeypatch):
    """Every layer windowed (12 tokens): 19 usable blocks of 4 hold 76 tokens, less than one
    prompt and its outputs (up to 112), so requests get through only because the blocks
    outside the window are freed; four at once also preempt each other. Async scheduling
    (the GPU default): blocks are freed while the previous step is still in flight."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model("mistral", tmp_path, sliding_window=12)
    stats = assert_greedy_matches_hf(
        folder, window_prompts(), device="cpu", block_size=4, num_gpu_blocks_override=20,
        max_num_batched_tokens=32, async_scheduling=True,
    )  # fmt: skip
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_qwen2_window_layers_match_hf(tmp_path, monkeypatch):
    """Qwen2 windows the layers from max_window_layers on (here layer 1 of 2): the global
    layer keeps every block."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model(
        "qwen2", tmp_path, use_sliding_window=True, sliding_window=9, max_window_layers=1
    )
    stats = assert_greedy_matches_hf(
        folder, window_prompts(), device="cpu", block_size=4, num_gpu_blocks_override=80,
        max_num_batched_tokens=48,
    )  # fmt: skip
    assert stats["num_preemptions"] > 0


def test_gpt_oss_all_windowed_frees_blocks_with_sinks(tmp_path, monkeypatch):
    """gpt-oss with every layer windowed (its default alternates): 15 usable blocks of 4 hold
    60 tokens, less than the longest request (80 + 32), so it gets through only because the
    blocks outside the window are freed; the sinks still join every softmax."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder = make_tiny_hf_model("gpt_oss", tmp_path, sliding_window=9, head_dim=16, std=0.3,
                                layer_types=["sliding_attention"] * 2, num_local_experts=4,
                                num_experts_per_tok=2)  # fmt: skip
    stats = assert_greedy_matches_hf(
        folder, window_prompts(), device="cpu", block_size=4, num_gpu_blocks_override=16,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert stats["num_preemptions"] > 0


# ---------------------------------------------------------------- GPU (H200)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "query_lens,context_lens,window,soft_cap",
    [
        ([1] * 64, [4095] * 64, 1024, None),  # decode batch, Mistral-like window
        ([1] * 2, [16383, 9000], 4096, None),  # long-context decode: split-KV in the window
        ([2048], [0], 512, 50.0),  # prefill, Gemma 2-like soft-cap
        ([512, 1, 1, 300] + [1] * 28, [1536, 4000, 100, 0] + [700] * 28, 1000, 30.0),
    ],
)
@pytest.mark.parametrize("block_size", [16, 64])
def test_kernel_window_gpu(dtype, query_lens, context_lens, window, soft_cap, block_size):
    batch = WindowBatch(query_lens, context_lens, 32, 8, 128, block_size, dtype,
                        window=window, soft_cap=soft_cap, seed=7)  # fmt: skip
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_mistral_window_gpu_float32_matches_hf(tmp_path):
    """The engine on CUDA (Triton kernels, CUDA graphs, async scheduling) in float32, blocks
    outside the window freed: the same greedy ids as HF on the CPU."""
    folder = make_tiny_hf_model("mistral", tmp_path, sliding_window=12)
    stats = assert_greedy_matches_hf(
        folder, window_prompts(), device="cuda", num_gpu_blocks_override=8,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert stats["num_preemptions"] > 0


ARCHITECTURES = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("name", ["mistral", "mistral-none", "qwen2-upper", "qwen3_moe", "gemma2"])
def test_scheduler_window_is_known_from_the_config(name):
    """The window the scheduler frees blocks behind comes from the config (no model built, no
    worker asked): the largest layer window when every layer has one, else None."""
    from transformers import AutoConfig

    from pagellm.models.registry import get_model_cls, kv_sliding_window

    model_type, overrides = LAYER_WINDOW_CONFIGS[name]
    kwargs = {**TINY_CONFIG, "num_hidden_layers": 4, "head_dim": 16, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    cls_name = ARCHITECTURES[model_type]
    windows = list(get_model_cls(cls_name).sliding_windows(config))
    expected = None if None in windows else max(windows)
    assert kv_sliding_window(cls_name, config) == expected
    assert (expected is not None) == (name in ("mistral", "qwen3_moe"))
