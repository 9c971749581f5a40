"""The delta a LoRA-wrapped Linear adds to its output: each row's adapter, from stacked slots.

A Linear with `lora` set (a `LoRASlots`) computes `out = base(x)` and then, for each adapter
slot a row of the step uses, `out[rows, part] += (x[rows] @ A[slot]^T) @ B[slot]^T * scale`,
PEFT's order of operations (`lora_B(lora_A(x)) * scaling`), in float32 on the CPU. A fused
projection (q | k | v, gate | up) has one (A, B) pair a part, each adding into its own output
columns (the parts' adapters applied per slice).

Adapters live in `max_loras` slots of stacked tensors, so a GPU kernel can index them by
slot: A [max_loras, R, in] and B [max_loras, out_part, R], R = max_lora_rank; an adapter of
rank r < R uses the first r of them. `LoRAStep` is the one object the slot manager sets
before each forward: the step's rows grouped by slot, shared by every wrapped layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LoRAStep:
    """The current step's rows grouped by adapter: (slot, rows [n] int64 or None for every
    row, rank, scale); empty when no row has an adapter."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None, int, float]] = []


class LoRASlots:
    """One Linear's adapter slots: a stacked (A, B) pair for each output part (`parts`:
    name -> (first, last) output column), and which parts each slot's adapter has."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        step: LoRAStep,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.parts = dict(parts)
        self.step = step
        self.a = {
            name: torch.zeros(max_loras, max_rank, in_features, device=device, dtype=dtype)
            for name in parts
        }
        self.b = {
            name: torch.zeros(max_loras, end - start, max_rank, device=device, dtype=dtype)
            for name, (start, end) in parts.items()
        }
        self.present: list[set[str]] = [set() for _ in range(max_loras)]

    def set_part(self, slot: int, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write a part's pair into a slot: a [r, in], b [out_part, r] (PEFT's layout)."""
        r = a.shape[0]
        self.a[name][slot].zero_()
        self.b[name][slot].zero_()
        self.a[name][slot, :r].copy_(a)
        self.b[name][slot, :, :r].copy_(b)
        self.present[slot].add(name)

    def clear_slot(self, slot: int) -> None:
        self.present[slot].clear()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # x: [T, in], out: [T, out] -> out with each row's adapter delta added
        for slot, rows, rank, scale in self.step.groups:
            names = self.present[slot]
            if not names:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for name in names:
                start, end = self.parts[name]
                a = self.a[name][slot, :rank]  # [r, in]
                b = self.b[name][slot, :, :rank]  # [out_part, r]
                delta = F.linear(F.linear(xs, a), b) * scale  # [n, out_part]
                if rows is None:
                    out[:, start:end] += delta
                else:
                    out[rows, start:end] += delta
        return out
