"""The delta a LoRA-wrapped Linear adds to its output: each row's adapter, from stacked slots.

A Linear with `lora` set (a `LoRASlots`) computes `out = base(x)` and then, for each adapter
slot a row of the step uses, `out[rows, part] += (x[rows] @ A[slot]^T) @ B[slot]^T * scale`,
PEFT's order of operations (`lora_B(lora_A(x)) * scaling`), summed in float32 on the CPU. A fused
projection (q | k | v, gate | up) has one (A, B) pair a part, each adding into its own output
columns (the parts' adapters applied per slice).

Adapters live in `max_loras` slots of stacked tensors, so a kernel can index them by slot:
on CUDA A [max_loras, R, in] and B [max_loras, out_part, R], R = max_lora_rank, views of one
stack a layer (every part's A along the rank, every part's B along the output columns: a
fused projection's delta is one shrink and one expand); on the CPU
both transposed, At [max_loras, in, R] and Bt [max_loras, R, out_part], which the C++ kernel
(`pagellm/kernels/lora_cpu.py`) reads along contiguous rows. An adapter of rank r < R uses
the first r of them (the rest are zeros). `LoRAStep` is the one object the slot manager sets
before each forward, shared by every wrapped layer: on the CPU the step's rows grouped by
slot, also as the C++ kernel's arrays, which the C++ decoder loop passes to the same kernel
(a step with adapter rows stays in the loop, bit for bit these layers' result); on CUDA each
row's slot and each slot's scale in device buffers that the Triton shrink / expand kernels
read (`pagellm/kernels/lora.py`: no host sync, the same memory every step, so a CUDA graph
may replay them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagellm.kernels import lora_cpu
from pagellm.layers.linear import Linear
from pagellm.utils import to_device


class LoRAStep:
    """The current step's rows by adapter. CPU: `groups`, (slot, rows [n] int64 or None for
    every row, rank, scale), empty when no row has an adapter. CUDA: the rows grouped by
    slot as the kernels take them (`kernels.lora_cpu.rows_by_slot`: `rows` [max_tokens] int32,
    `starts` [max_loras + 1] int32) and `scales` [max_loras] float32, views of buffers kept
    for the engine's life (`max_tokens` rows, a step's most), which captured CUDA graphs
    read: each step writes them before the replay (a graph's padding rows have no slot);
    `num_rows` is the step's (or the graph's) T."""

    def __init__(self, max_tokens: int = 256) -> None:
        self.groups: list[tuple[int, torch.Tensor | None, int, float]] = []
        # the same groups as the C++ kernel takes them: rows sorted by slot, LoraGroup array
        self.kernel_rows, self.kernel_groups = lora_cpu.groups_of(np.zeros(0, np.int64), [], [])
        self.rows: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.num_rows: int | None = None
        self.max_tokens = max_tokens
        self.max_rank = 0  # the slots' R (`LoRASlots` sets it)
        self._meta_buf: torch.Tensor | None = None  # rows, then starts

    def set_rows(
        self,
        token_slots: np.ndarray,  # [T] int, -1: the base model
        scales: Sequence[float],  # per slot
        ranks: Sequence[int],  # per slot
        device: torch.device,
        pad_to: int | None = None,  # CUDA: a graph's rows (T and -1 after them)
    ) -> None:
        if device.type == "cuda":
            self._set_device_rows(token_slots, scales, device, pad_to or len(token_slots))
            return
        groups = []
        for slot in np.unique(token_slots):
            if slot < 0:
                continue
            mask = token_slots == slot
            rows = None if mask.all() else torch.from_numpy(np.nonzero(mask)[0]).to(device)
            groups.append((int(slot), rows, ranks[slot], scales[slot]))
        self.groups = groups
        self.kernel_rows, self.kernel_groups = lora_cpu.groups_of(token_slots, ranks, scales)

    def graph_rows(self, size: int, num_slots: int, device: torch.device) -> None:
        """A CUDA graph of `size` rows: its kernels read the buffers (each replay's step
        fills them). The warm-up before a capture makes them (no row has a slot); inside the
        capture nothing is copied from the host (a capture may not)."""
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            self._set_device_rows(np.full(size, -1), [0.0] * num_slots, device, size)
        self.num_rows = size

    def _set_device_rows(self, token_slots: np.ndarray, scales, device, rows: int) -> None:
        num_slots = len(scales)
        if self._meta_buf is None:  # once: captured graphs read this memory
            self._meta_buf = torch.full((self.max_tokens + num_slots + 1,), -1,
                                        dtype=torch.int32, device=device)  # fmt: skip
            self.rows, self.starts = self._meta_buf.split([self.max_tokens, num_slots + 1])
            self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        if rows > self.max_tokens:  # the step buffers' size (`StepInputs`) bounds every step
            raise ValueError(f"a step of {rows} tokens; LoRA rows are kept for {self.max_tokens}")
        grouped, starts = lora_cpu.rows_by_slot(token_slots, num_slots)
        host = np.full(self._meta_buf.shape[0], -1, dtype=np.int32)
        host[: len(grouped)] = grouped
        host[self.max_tokens :] = starts
        # through pinned memory: a pageable copy would wait for the step in flight
        self._meta_buf.copy_(to_device(host, device))
        self.scales.copy_(to_device(np.asarray(scales, dtype=np.float32), device))
        self.num_rows = rows


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
        self.max_rank = step.max_rank = max_rank
        self.transposed = device.type == "cpu"  # At [S, in, R], Bt [S, R, out]: the C++ kernel's
        zeros = functools.partial(torch.zeros, max_loras, device=device, dtype=dtype)
        self.a, self.b = {}, {}
        self.fused = None  # CUDA: every part's A and B stacked, for one shrink and one expand
        if not self.transposed:
            from pagellm.kernels.lora import MAX_PARTS

            if len(parts) > MAX_PARTS:  # no served family fuses more (q | k | v is the most)
                raise ValueError(f"a fused layer of {len(parts)} LoRA parts; the kernels take "
                                 f"at most {MAX_PARTS}")  # fmt: skip
            ends = [end for _, end in self.parts.values()]
            self.fused = (zeros(len(parts) * max_rank, in_features), zeros(ends[-1], max_rank),
                          tuple(ends))  # fmt: skip
        for i, (name, (start, end)) in enumerate(parts.items()):
            if self.fused is not None:  # views of the stacks: A's ranks, B's output rows
                self.a[name] = self.fused[0][:, i * max_rank : (i + 1) * max_rank]
                self.b[name] = self.fused[1][:, start:end]
                continue
            a, b = (in_features, max_rank), (end - start, max_rank)
            self.a[name] = zeros(*a)
            self.b[name] = zeros(*b[::-1])
        self.present: list[set[str]] = [set() for _ in range(max_loras)]
        # CPU: per part, whether each slot's adapter has it (the kernel reads these in place)
        self.present_flags = {name: torch.zeros(max_loras, dtype=torch.uint8) for name in parts}
        self.kernel_parts = lora_cpu.parts_of([
            (self.a[n], self.b[n], self.present_flags[n], start, end - start)
            for n, (start, end) in self.parts.items()
        ]) if self.transposed else None  # fmt: skip

    def set_part(self, slot: int, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write a part's pair into a slot: a [r, in], b [out_part, r] (PEFT's layout)."""
        r = a.shape[0]
        self.a[name][slot].zero_()
        self.b[name][slot].zero_()
        if self.transposed:
            self.a[name][slot, :, :r].copy_(a.t())
            self.b[name][slot, :r].copy_(b.t())
        else:
            self.a[name][slot, :r].copy_(a)
            self.b[name][slot, :, :r].copy_(b)
        self.present[slot].add(name)
        self.present_flags[name][slot] = 1

    def clear_slot(self, slot: int) -> None:
        """The slot's parts zeroed: the CUDA kernels apply every part (a zero one adds 0)."""
        for name in self.present[slot]:
            self.a[name][slot].zero_()
            self.b[name][slot].zero_()
            self.present_flags[name][slot] = 0
        self.present[slot].clear()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # x: [T, in], out: [T, out] -> out with each row's adapter delta added
        if x.is_cuda:
            return self._on_cuda(x, out)
        step = self.step
        if not step.groups:
            return out
        if lora_cpu.available() and x.dtype in lora_cpu.KINDS and out.stride(1) == 1:
            return lora_cpu.add(
                x, out, self.kernel_parts, self.max_rank, step.kernel_rows, step.kernel_groups
            )
        for slot, rows, rank, scale in step.groups:  # torch: no C++ kernel here
            xs = x if rows is None else x.index_select(0, rows)
            for name in self.present[slot]:
                start, end = self.parts[name]
                a = self.a[name][slot, :, :rank]  # [in, r]
                b = self.b[name][slot, :rank]  # [r, out_part]
                delta = (xs @ a) @ b * scale  # [n, out_part]
                if rows is None:
                    out[:, start:end] += delta
                else:
                    out[rows, start:end] += delta
        return out

    def _on_cuda(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every part's shrink and expand over all rows, each row by its slot's program: one
        shrink and one expand for all of a fused layer's parts (q | k | v)."""
        from pagellm.kernels.lora import lora_expand, lora_shrink

        step = self.step
        if step.num_rows != x.shape[0]:
            return out  # no adapter was ever set up for rows of this step (profiling)
        x = x.contiguous()
        a, b, ends = self.fused
        h = lora_shrink(x, a, step.rows, step.starts, step.scales)
        return lora_expand(h, b, step.rows, step.starts, out, 0, ends)


@dataclass(frozen=True)
class LoRATarget:
    """A PEFT module of a decoder layer (its path in HF's layer, e.g. "self_attn.q_proj") as
    our layer holds it: the Linear at `linear`, one fused `part` of it (None: the whole), and
    the one-rank shapes an adapter's A [r, fan_in] and B [fan_out, r] must have."""

    linear: str
    part: str | None
    fan_in: int
    fan_out: int


def lora_targets(layer: nn.Module) -> dict[str, LoRATarget]:
    """The PEFT module names a decoder layer's Linears answer to, whatever the family: each
    Linear its own path (StarCoder2's `mlp.c_fc`, Phi-3's fused `self_attn.qkv_proj`), a fused
    one also each part's (`self_attn.q_proj` of `self_attn.qkv_proj`, as HF's Llama names
    it). A Linear without a quantization method (an MoE router) takes no adapter."""
    targets = {}
    for path, module in layer.named_modules():
        if not isinstance(module, Linear) or not module.quantizable:
            continue
        fan_in = getattr(module, "full_in_features", module.in_features)
        full_rows = getattr(module, "full_rows", None)  # a FusedLinear's parts
        if full_rows is None:
            fan_out = getattr(module, "full_out_features", module.out_features)
            targets[path] = LoRATarget(path, None, fan_in, fan_out)
            continue
        targets[path] = LoRATarget(path, None, fan_in, sum(full_rows.values()))
        prefix = path.rpartition(".")[0]
        for shard, rows in full_rows.items():
            name = f"{prefix}.{shard}" if prefix else shard
            targets[name] = LoRATarget(path, shard, fan_in, rows)
    return targets


def rank_parts(
    linear: nn.Module, part: str | None, a: torch.Tensor, b: torch.Tensor
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(slot part, A, B) this tensor-parallel rank holds of a module's pair, cut as the base
    layer is: a column-parallel layer's B by its output rows (a fused layer's per part; a
    whole-fused target split into its parts first), a row-parallel layer's A by its input
    columns (each rank's partial delta then summed by the layer's own all-reduce)."""
    parts = getattr(linear, "parts", None)  # FusedLinear: shard -> this rank's rows
    if isinstance(parts, dict):
        if part is None:
            split = b.split(list(linear.full_rows.values()))
            return [(s, a, _cut(bs, parts[s])) for s, bs in zip(linear.full_rows, split)]
        return [(part, a, _cut(b, parts[part]))]
    cut = getattr(linear, "part", None)  # Column- or RowParallelLinear
    if cut is None:
        return [("", a, b)]
    return [("", a, _cut(b, cut))] if cut.dim == 0 else [("", _cut(a, cut), b)]


def _cut(t: torch.Tensor, piece) -> torch.Tensor:
    """`piece` (a `TensorSlice`) of `t`: rows (dim 0) of a B, columns (dim 1) of an A."""
    return t.narrow(piece.dim, piece.start, piece.size).contiguous()
