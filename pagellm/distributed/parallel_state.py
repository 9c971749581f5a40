"""The tensor-parallel group of this process and the collectives the sharded layers call.

A worker process is one rank of one group (`init_tensor_parallel`); every other process, the
single-process engine included, is rank 0 of a group of 1, where each collective returns its
input untouched and torch.distributed is never initialized. The group is process-wide state,
read when a model is built (how many heads, rows, vocabulary entries each layer holds) and by
the layers' forward (the all-reduce after a row-parallel projection).

On CUDA the collectives are NCCL's, issued on the current stream, so a decode forward with
its all-reduces is captured in a CUDA graph like any other kernel; on the CPU they are gloo's.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None for a group of 1


_GROUP = TensorParallelGroup()
# how long a rank waits for its peers at start-up (TCPStore, first collective)
INIT_TIMEOUT = datetime.timedelta(minutes=10)


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


def init_tensor_parallel(
    rank: int, size: int, host: str, port: int, device: torch.device
) -> TensorParallelGroup:
    """Join the group whose TCPStore listens at host:port (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    global _GROUP
    store = dist.TCPStore(host, port, size, is_master=False, timeout=INIT_TIMEOUT)
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=INIT_TIMEOUT,
        device_id=device if cuda else None,  # NCCL: create the communicator now
    )
    _GROUP = TensorParallelGroup(rank, size, dist.group.WORLD)
    return _GROUP


def destroy_tensor_parallel() -> None:
    import torch.distributed as dist

    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()


def divide(total: int, what: str) -> int:
    """`total / tp_size`, or a ValueError naming `what` when the ranks cannot share it evenly."""
    size = _GROUP.size
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} must divide {what} ({total})")
    return total // size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum."""
    if _GROUP.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=_GROUP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., size * n], rank 0's part first."""
    if _GROUP.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP.group)
    return torch.cat(parts, dim=-1)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place."""
    if _GROUP.size > 1:
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=_GROUP.group)
    return x


@contextlib.contextmanager
def building_rank(rank: int, size: int) -> Iterator[TensorParallelGroup]:
    """Act as `rank` of `size` without a process group: to build and load one rank's shard
    of a model in this process (tests, checks); a collective inside the block fails."""
    global _GROUP
    previous, _GROUP = _GROUP, TensorParallelGroup(rank, size)
    try:
        yield _GROUP
    finally:
        _GROUP = previous
