"""The KV cache's size arithmetic, in one place: the engine sizes its cache with these
functions (`ModelRunner`, `profiled_kv_budget`, `KVCacheManager.max_request_len`) and
`pagellm plan` (`pagellm/engine/plan.py`) predicts it with the same ones, so the two cannot
drift apart.

Every layer's cache holds every block (`[2, num_blocks, block_size, kv_heads, head_dim]`
per layer; `[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]` for latent
attention, one row a token shared by every head: `latent_kv_dim`), block 0 is the null
block (never handed out), and a model whose every layer is windowed frees a request's
blocks that fall wholly before its window.
"""

from __future__ import annotations

# kept free on a GPU beyond the profiled peak: CUDA graphs' pool, allocator fragmentation
GPU_MEMORY_MARGIN = 512 << 20


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def latent_kv_dim(hf_config: object) -> int | None:
    """Multi-head latent attention (DeepSeek V2 / V3, `kv_lora_rank` in the config): a layer
    caches one row a token, the compressed latent (kv_lora_rank) then the rotated key part
    (qk_rope_head_dim), shared by every head; its width, or None for per-head K and V."""
    rank = getattr(hf_config, "kv_lora_rank", None)
    if not rank:
        return None
    return int(rank) + int(hf_config.qk_rope_head_dim)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int, parts: int = 2
) -> int:
    """One token's K and V over all layers, of one rank (`num_kv_heads`: that rank's;
    `parts` 1: one latent row, no separate V)."""
    return parts * num_layers * num_kv_heads * head_dim * itemsize


def kv_block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    block_size: int,
    parts: int = 2,
) -> int:
    """One KV block of one rank: `block_size` tokens in every layer."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, itemsize, parts)


def gpu_kv_budget(total: int, utilization: float, not_torch: int, peak: int) -> int:
    """Bytes a GPU gives its KV cache: `utilization` of the card, less what torch does not
    allocate (CUDA context, NCCL), the profiled peak (weights, buffers, a full step's
    activations and sampling) and the margin."""
    return int(total * utilization) - not_torch - peak - GPU_MEMORY_MARGIN


def num_kv_blocks(budget: int, block_bytes: int) -> int:
    """Blocks a budget buys; a ValueError below 2 (the null block and one more)."""
    blocks = budget // block_bytes
    if blocks < 2:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds fewer than 2 blocks of "
            f"{block_bytes} bytes; raise kv_cache_memory_bytes"
        )
    return int(blocks)


def kv_capacity_tokens(num_blocks: int, block_size: int) -> int:
    """Tokens the cache holds: every block but the null block."""
    return (num_blocks - 1) * block_size


def max_request_len(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    sliding_window: int | None,
    max_num_batched_tokens: int,
) -> int:
    """The longest request the cache holds: max_model_len, or fewer tokens if the whole
    cache holds fewer (with every layer windowed a step needs at most the window before its
    first token and a full token budget after it)."""
    capacity = kv_capacity_tokens(num_blocks, block_size)
    needed = max_num_batched_tokens + block_size
    if sliding_window is not None and capacity >= sliding_window + needed:
        return max_model_len
    return min(capacity, max_model_len)


def request_blocks(length: int, block_size: int, sliding_window: int | None = None) -> int:
    """Blocks a request of `length` tokens holds in a decode step: all of its blocks, or
    (every layer windowed) those the window of its last token touches."""
    blocks = cdiv(length, block_size)
    if sliding_window is None:
        return blocks
    return min(blocks, cdiv(sliding_window - 1, block_size) + 1)


def max_concurrent_requests(
    num_blocks: int, block_size: int, length: int, sliding_window: int | None = None
) -> int:
    """Requests of `length` tokens whose blocks the cache holds at once."""
    return (num_blocks - 1) // request_blocks(length, block_size, sliding_window)
