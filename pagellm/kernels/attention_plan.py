"""Planning for the paged attention kernels: tile shapes, launches, split-KV, tile order.

`plan_attention` turns one step's query_start_loc / seq_lens (host copies) into launches:
a decode launch (every request whose query fits one tile) and a prefill launch with a
tile -> (request, first query) map, and decides the split-KV count for decodes.

Tiles run longest first, so the launch does not end on a few long programs: the host
orders the maps it builds. A decode-only step has no map (tile i is request i, which keeps
it CUDA-graph friendly); `order_by_length` builds its map on the device from the live
`seq_lens`, one small sort per step (4.07 -> 4.28 TB/s of K/V on a Llama-3.1-8B decode step
of the standard workload, H200; see docs/notes.md, GPU throughput).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton

from pagellm.utils import to_device

TARGET_WAVES = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
DEFAULT_NUM_SMS = 132  # H200; used when planning for a non-CUDA device (interpreter tests)


@dataclass(frozen=True)
class TileConfig:
    """Compile-time shape of one launch; the knobs worth sweeping on a new GPU."""

    heads_per_prog: int  # query heads of one KV head per program (power of two)
    block_q: int  # query tokens per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.heads_per_prog


# Decode tiles by the bytes of one cached K/V element: (keys per step, warps, stages). Each
# entry is a sweep's knob (`benchmarks/decode_step.py --sweep [--kv-cache-dtype fp8]`).
# 16-bit: steps of 32 with 2 warps, 4.33 TB/s against 4.22 for steps of 64 with 4 warps on a
# decode step of the standard workload (H200, 28 layers in one CUDA graph; see
# docs/notes.md); smaller tiles let more programs share an SM. The same for every
# head_dim (16-bit heads of 256: three stages of 32 keys are 96 KB of shared memory).
# fp8: one warp a program, steps of 32 keys, 4 stages: 3.14 / 3.15 TB/s of fp8 K/V
# (Qwen3-0.6B / Llama-3.1-8B shapes) against 2.73 / 2.82 for 64 keys with 2 warps (the
# 16-bit tiles' bytes a step); 16 keys, 1 warp: 2.93 / 3.28. An fp8 byte carries twice the
# work of a 16-bit one (conversion through shared memory, softmax), and more, smaller
# programs an SM hide more of that work's latency (H200, `--kv-cache-dtype fp8 --sweep`;
# docs/notes.md, fp8 decode attention).
DECODE_TILES: dict[int, tuple[int, int, int]] = {
    4: (32, 2, 3),
    2: (32, 2, 3),
    1: (32, 1, 4),
}
# Where the query heads a KV head change the best tile: (element size, heads a program) ->
# tile. fp8 with 4 query heads a KV head (Llama-3.1-8B): 16 keys a step, 3.27-3.28 against
# 3.14 TB/s for 32; 2 heads (Qwen3-0.6B) and 8 (Qwen3-30B-A3B) keep 32 keys (3.14 against
# 2.93, 2.80 against 2.38).
DECODE_TILES_BY_HEADS: dict[tuple[int, int], tuple[int, int, int]] = {
    (1, 4): (16, 1, 4),
}


def decode_tile(kv_element_size: int, heads_per_prog: int) -> tuple[int, int, int]:
    """(keys per step, warps, stages) of the decode tile for this cache element and head group."""
    default = DECODE_TILES[kv_element_size]
    return DECODE_TILES_BY_HEADS.get((kv_element_size, heads_per_prog), default)


def decode_config(queries_per_kv: int, head_dim: int, kv_element_size: int = 2) -> TileConfig:
    """Small tiles (BLOCK_M = 16, the smallest `tl.dot` M), few warps: memory-bound.
    Keys per step, warps and stages from `decode_tile`."""
    heads = min(triton.next_power_of_2(queries_per_kv), 16)
    block_n, warps, stages = decode_tile(kv_element_size, heads)
    return TileConfig(heads, max(1, 16 // heads), block_n, num_warps=warps, num_stages=stages)


def prefill_config(queries_per_kv: int, head_dim: int, element_size: int = 2) -> TileConfig:
    """BLOCK_M = 128 rows (query tokens x heads of one KV head): compute-bound."""
    heads = min(triton.next_power_of_2(queries_per_kv), 8)
    if head_dim <= 64:
        return TileConfig(heads, 128 // heads, 64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        # 16-bit: key steps of 128, 427-438 TFLOP/s against 404 for 64 (docs/notes.md);
        # fp32 tiles that size would not fit in shared memory
        block_n = 128 if element_size <= 2 else 64
        return TileConfig(heads, 128 // heads, block_n, num_warps=8, num_stages=3)
    return TileConfig(heads, 64 // heads, 32, num_warps=8, num_stages=2)


@dataclass
class Launch:
    """One launch of `_paged_attention_kernel` over some of the step's requests."""

    config: TileConfig
    num_tiles: int
    num_splits: int
    tile_req: torch.Tensor | None  # [num_tiles] int32; None: tile i is request i
    tile_q: torch.Tensor | None  # [num_tiles] int32 first query of each tile


@dataclass
class AttentionPlan:
    """Everything host-side for one step and one head layout; reused by every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    launches: list[Launch]
    sliding_window: int | None = None  # the kernel's WINDOW: each query's last keys


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Segments per decode tile: enough programs for TARGET_WAVES waves, never short ones."""
    target = TARGET_WAVES * num_sms
    if num_programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, num_programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _tile_map(
    reqs: np.ndarray, q_lens: np.ndarray, kv_ends: np.ndarray, block_q: int, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(request, first query) of every BLOCK_Q-token tile of `reqs`, most keys first."""
    tiles_per_req = -(-q_lens[reqs] // block_q)
    tile_req = np.repeat(reqs, tiles_per_req)
    first_tile = np.repeat(np.cumsum(tiles_per_req) - tiles_per_req, tiles_per_req)
    tile_q = (np.arange(len(tile_req)) - first_tile) * block_q
    # keys a tile visits: context + queries up to the tile's last one
    work = kv_ends[tile_req] - q_lens[tile_req] + np.minimum(tile_q + block_q, q_lens[tile_req])
    if window is not None:  # a tile's rows see at most window + block_q - 1 keys together
        work = np.minimum(work, window + block_q - 1)
    order = np.argsort(-work, kind="stable")
    return tile_req[order], tile_q[order]


def plan_attention(
    query_start_loc_cpu: np.ndarray,  # [num_reqs + 1] int32
    seq_lens_cpu: np.ndarray,  # [num_reqs] int32
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    *,
    num_splits: int | None = None,
    decode: TileConfig | None = None,
    prefill: TileConfig | None = None,
    element_size: int = 2,
    sliding_window: int | None = None,
    kv_element_size: int | None = None,
) -> AttentionPlan:
    """Split the step's requests into a decode launch and a prefill launch (host work only).

    Requests whose query fits one decode tile (query_len <= decode.block_q) go to the
    decode launch; when every request does, that launch needs no tile map (tile i is
    request i), which keeps it CUDA-graph friendly. A decode-only launch splits its keys
    (`choose_num_splits`), one beside prefill tiles does not, unless `num_splits` forces a
    count. The rest become prefill tiles, ordered heaviest first. `element_size` is the
    bytes of one q/K/V element (it bounds the prefill tile), `kv_element_size` those of a
    cached one (fp8: 1; None: element_size; it picks the decode tile). With a
    `sliding_window` a query reads at most that many keys, which the split count and tile
    order use.
    """
    device = torch.device(device)
    queries_per_kv = num_heads // num_kv_heads
    decode = decode or decode_config(queries_per_kv, head_dim, kv_element_size or element_size)
    prefill = prefill or prefill_config(queries_per_kv, head_dim, element_size)
    qsl = np.asarray(query_start_loc_cpu, dtype=np.int64)
    seq_lens = np.asarray(seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    is_decode = q_lens <= decode.block_q
    dec_reqs = np.flatnonzero(is_decode)
    dec_reqs = dec_reqs[np.argsort(-seq_lens[dec_reqs], kind="stable")]  # longest first
    pre_reqs = np.flatnonzero(~is_decode)

    host_maps: list[np.ndarray] = []
    pending: list[tuple[TileConfig, int, int]] = []  # config, num_tiles, num_splits
    if len(dec_reqs):
        splits = num_splits or _decode_splits(
            decode, seq_lens[dec_reqs], num_heads // num_kv_heads, num_kv_heads,
            sliding_window, device, beside_prefill=len(pre_reqs) > 0,
        )  # fmt: skip
        pending.append((decode, len(dec_reqs), splits))
        if len(pre_reqs):
            host_maps += [dec_reqs, np.zeros_like(dec_reqs)]
    if len(pre_reqs):
        tile_req, tile_q = _tile_map(pre_reqs, q_lens, seq_lens, prefill.block_q, sliding_window)
        pending.append((prefill, len(tile_req), 1))
        host_maps += [tile_req, tile_q]

    maps = _maps_to_device(host_maps, device)
    launches = []
    for config, num_tiles, splits in pending:
        tile_req, tile_q = (maps.pop(0), maps.pop(0)) if maps else (None, None)
        launches.append(Launch(config, num_tiles, splits, tile_req, tile_q))
    return AttentionPlan(num_heads, num_kv_heads, head_dim, launches, sliding_window)


def _decode_splits(
    decode: TileConfig,
    seq_lens: np.ndarray,  # of the decode launch's requests
    queries_per_kv: int,
    num_kv_heads: int,
    sliding_window: int | None,
    device: torch.device,
    beside_prefill: bool,
) -> int:
    """How many key segments the decode launch splits each request into. A step with
    prefill tiles keeps its decodes whole: the prefill fills the GPU, and one variant fewer
    is compiled while serving."""
    if beside_prefill:
        return 1
    groups = triton.cdiv(queries_per_kv, decode.heads_per_prog)
    programs = len(seq_lens) * num_kv_heads * groups
    max_keys = int(seq_lens.max())
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window + decode.block_q - 1)
    return choose_num_splits(programs, max_keys, _num_sms(device))


def _maps_to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """One (pinned, async) host-to-device copy for all tile maps.

    Each map starts on a 16-byte boundary: Triton specializes a kernel on its pointers'
    alignment, and maps packed back to back would compile new variants as lengths vary.
    """
    if not arrays:
        return []
    padded = [-(-len(a) // 4) * 4 for a in arrays]  # int32 elements, 16-byte multiples
    flat_host = np.zeros(sum(padded), dtype=np.int32)
    starts = np.cumsum([0, *padded[:-1]])
    for start, a in zip(starts, arrays):
        flat_host[start : start + len(a)] = a
    flat = to_device(flat_host, device)
    return [flat[start : start + len(a)] for start, a in zip(starts, arrays)]


def order_by_length(launch: Launch, seq_lens: torch.Tensor) -> Launch:
    """A decode-only launch with a tile map that runs the longest requests first, built on
    the device from `seq_lens` (so a CUDA graph replay orders by the live lengths).

    torch ops, not a Triton kernel: `compile_ahead`'s dry passes skip Triton kernels not yet
    compiled, and a skipped sort would leave garbage request indices for the attention.
    """
    if launch.tile_req is not None or launch.num_tiles < 2:
        return launch
    n = launch.num_tiles
    order = torch.sort(seq_lens[:n], descending=True).indices.to(torch.int32)
    return Launch(launch.config, n, launch.num_splits, order, torch.zeros_like(order))
