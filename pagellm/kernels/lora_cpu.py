"""LoRA deltas on the CPU (`pagellm/csrc/lora_cpu.cpp`): each row's adapter, rows grouped by
slot, added into a projection's output parts in one call.

The Python layers (`pagellm.lora.layers.LoRASlots`) call `add` after a LoRA-wrapped Linear's
base GEMM; the C++ decoder loop (`pagellm.layers.cpu_decoder`) calls the same entry point
(`entry_point()`) after each of its projections, so a step with adapter rows stays in the
loop and gives the layers' bits. Where the library cannot be built, `available()` is False
and the layers compute the deltas with torch (the loop then leaves such steps to them).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np
import torch

from pagellm import cpp_build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
KINDS = {torch.float32: 0, torch.bfloat16: 1}


class LoraGroup(ctypes.Structure):
    """rows[first : first + count] use adapter slot `slot` (its rank and scale)."""

    _fields_ = [(n, _I64) for n in ("slot", "first", "count", "rank")] + [("scale", ctypes.c_float)]


class LoraPart(ctypes.Structure):
    """One output part's adapters: At [slots, K, R], Bt [slots, R, cols], present [slots]
    uint8, its columns [start, start + cols); null `at`: nothing to add."""

    _fields_ = [(n, _P) for n in ("at", "bt", "present")] + [(n, _I64) for n in ("start", "cols")]


_SIGNATURE = [_P, _I64, _P, _I64, ctypes.POINTER(LoraPart), _I64, _I64, _P,
              ctypes.POINTER(LoraGroup), _I64, ctypes.c_int]  # fmt: skip


@functools.cache
def entry_point():
    """`pagellm_lora_add`, or None where it cannot be built here."""
    return cpp_build.entry_point(
        "lora_cpu", "pagellm_lora_add", _SIGNATURE, ctypes.c_int, "LoRA deltas through torch"
    )


def available() -> bool:
    return entry_point() is not None


def pointer(fn) -> int:
    return ctypes.cast(fn, _P).value


def rows_by_slot(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows [T] int32: the rows of slot 0, then slot 1, ..., in order, -1 after the last;
    starts [num_slots + 1] int32: slot s's rows are rows[starts[s]:starts[s + 1]]). A slot
    of -1 (no adapter) is left out."""
    token_slots = np.asarray(token_slots)
    slots = np.where(token_slots >= 0, token_slots, num_slots)  # no adapter: last, dropped
    order = np.argsort(slots, kind="stable")
    counts = np.bincount(slots, minlength=num_slots + 1)[:num_slots]
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    rows = np.full(len(token_slots), -1, dtype=np.int32)
    rows[: starts[-1]] = order[: starts[-1]]
    return rows, starts


def groups_of(token_slots: np.ndarray, ranks: Sequence[int], scales: Sequence[float]):
    """(rows [n] int64 tensor sorted by slot, LoraGroup array) of a step's rows (-1: none):
    `rows_by_slot`'s grouping, one group a slot that has rows."""
    rows, starts = rows_by_slot(token_slots, len(ranks))
    groups = [LoraGroup(slot, int(starts[slot]), int(starts[slot + 1] - starts[slot]),
                        ranks[slot], scales[slot])
              for slot in range(len(ranks)) if starts[slot + 1] > starts[slot]]  # fmt: skip
    return torch.from_numpy(rows[: starts[-1]].astype(np.int64)), (LoraGroup * len(groups))(*groups)


def add(
    x: torch.Tensor,  # [T, K]
    out: torch.Tensor,  # [T, N], rows contiguous
    parts: ctypes.Array,  # LoraPart
    max_rank: int,
    rows: torch.Tensor,  # groups_of's
    groups: ctypes.Array,
) -> torch.Tensor:
    """out with each grouped row's delta added, in place."""
    x = x.contiguous()
    if out.stride(1) != 1 or x.dtype != out.dtype or x.dtype not in KINDS:
        raise ValueError("lora_cpu.add: out's rows must be contiguous, of x's float dtype")
    if entry_point()(
        x.data_ptr(), x.shape[1], out.data_ptr(), out.stride(0), parts, len(parts), max_rank,
        rows.data_ptr(), groups, len(groups), KINDS[x.dtype],
    ):  # fmt: skip
        raise ValueError(f"lora_cpu.add: an adapter's rank is over {max_rank}")
    return out


def parts_of(parts: Sequence[tuple]) -> ctypes.Array:
    """A LoraPart array of (At, Bt, present, start, cols) tuples (None for a part: none)."""
    entries = [
        LoraPart()
        if p is None
        else LoraPart(p[0].data_ptr(), p[1].data_ptr(), p[2].data_ptr(), p[3], p[4])  # fmt: skip
        for p in parts
    ]
    return (LoraPart * len(entries))(*entries)
