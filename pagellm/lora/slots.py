"""The runner's LoRA slot manager: adapters into `max_loras` slots between steps.

At start-up every projection of the decoder layers gets a `LoRASlots` (`pagellm.lora.layers`),
all sharing one `LoRAStep`; the PEFT module names each answers to are its own and its fused
parts' (`lora_targets`), whatever the family. With tensor parallelism each rank keeps its
cut of every adapter, A or B sharded as the base layer is (`rank_parts`). Before each forward,
`prepare_step` makes each adapter of the step's rows resident (from the host cache of
`max_cpu_loras` adapters, or read from its folder), evicting the least recently used slot
that this step does not use (the scheduler admits at most `max_loras` adapters at once), and
groups the step's token rows by slot. On CUDA the slot and scale buffers are the engine's
for its life, so decode steps replay CUDA graphs with any mix of adapters. On the CPU the
C++ one-call decoder runs steps with adapter rows too: it adds the deltas through the
kernel the layers' own forward calls (`pagellm.kernels.lora_cpu`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from torch import nn

from pagellm.config.lora import LoRAConfig
from pagellm.lora.layers import LoRASlots, LoRAStep, lora_targets, rank_parts
from pagellm.lora.peft import LoRAAdapter, load_adapter, target_shapes
from pagellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRASlotManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, device, dtype, max_tokens: int
    ) -> None:
        self.config = config
        self.step = LoRAStep(max_tokens)
        self.device = device
        self.dtype = dtype
        # (layer, PEFT module) -> (its Linear's slots, the Linear, the fused part or None)
        self.targets: dict[tuple[int, str], tuple[LoRASlots, nn.Module, str | None]] = {}
        self._attach(model)
        self.shapes = target_shapes(model.model.layers, getattr(model, "lora_fused_names", False))
        logger.info(
            "LoRA: %d slots of rank up to %d on %d projections, a host cache of %d adapters",
            config.max_loras, config.max_lora_rank, len(self._all_slots()),
            config.host_cache_size,
        )  # fmt: skip
        self.requests: dict[str, int] = {}  # request id -> adapter id
        self.paths: dict[int, str] = {}  # adapter id -> its folder
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.adapters: dict[int, LoRAAdapter] = {}  # adapter id -> the one in its slot
        # adapters of the engine's unfinished requests (waiting too), as of the last add
        self.live: set[int] = set()

    def _attach(self, model: nn.Module) -> None:
        for i, layer in enumerate(model.model.layers):
            for module, target in lora_targets(layer).items():
                linear = layer.get_submodule(target.linear)
                if linear.lora is None:
                    linear.lora = self._slots_for(linear)
                self.targets[i, module] = (linear.lora, linear, target.part)

    def _all_slots(self) -> list[LoRASlots]:
        return list({id(t[0]): t[0] for t in self.targets.values()}.values())

    def _slots_for(self, linear: nn.Module) -> LoRASlots:
        rows = getattr(linear, "shard_rows", None)  # a fused layer's parts
        parts = rows if rows is not None else {"": (0, linear.out_features)}
        c = self.config
        return LoRASlots(
            linear.in_features, parts, c.max_loras, c.max_lora_rank, self.step, self.device,
            self.dtype,
        )  # fmt: skip

    def add_request(self, req_id: str, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            self.requests.pop(req_id, None)
            return
        self.requests[req_id] = lora_request.lora_int_id
        self._set_path(lora_request)

    def _set_path(self, lora_request: LoRARequest) -> None:
        if self.paths.get(lora_request.lora_int_id) != lora_request.lora_path:
            self.forget(lora_request.lora_int_id)  # another folder under this id
            self.paths[lora_request.lora_int_id] = lora_request.lora_path

    def add_adapter(self, lora_request: LoRARequest, live: Sequence[int] = ()) -> None:
        """Read an adapter into the host cache now, off the step (ValueError: it does not fit);
        `live`: the adapters the engine's other unfinished requests use, kept there."""
        self.live = set(live)
        self._set_path(lora_request)
        self._host_adapter(lora_request.lora_int_id)

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def forget(self, adapter_id: int) -> None:
        """Drop an adapter from the host cache and its slot (unloaded, or its folder changed)."""
        self.host.pop(adapter_id, None)
        self.adapters.pop(adapter_id, None)
        slot = self.resident.pop(adapter_id, None)
        if slot is not None:
            for slots in self._all_slots():
                slots.clear_slot(slot)

    def prepare_graph(self, size: int) -> None:
        """A CUDA graph of `size` rows is captured next: its kernels read the step's slot and
        scale buffers (`LoRAStep`), which each replayed step fills (`prepare_step`)."""
        self.step.graph_rows(size, self.config.max_loras, self.device)

    def prepare_step(
        self, req_ids: Sequence[str], num_scheduled: np.ndarray, pad_to: int | None = None
    ) -> None:
        """Make the step's adapters resident and group its token rows by slot (a CUDA graph
        replay: `pad_to` rows, the padding's without an adapter)."""
        ids = [self.requests.get(r, 0) for r in req_ids]
        used = set(ids) - {0}
        row_slots = np.array([self._slot(i, used) if i else -1 for i in ids], dtype=np.int64)
        scales, ranks = [0.0] * self.config.max_loras, [0] * self.config.max_loras
        for adapter_id, slot in self.resident.items():
            scales[slot] = self.adapters[adapter_id].scaling
            ranks[slot] = self.adapters[adapter_id].rank
        token_slots = np.repeat(row_slots, num_scheduled)
        self.step.set_rows(token_slots, scales, ranks, self.device, pad_to)

    def _slot(self, adapter_id: int, used: set[int]) -> int:
        slot = self.resident.get(adapter_id)
        if slot is not None:
            self.resident.move_to_end(adapter_id)
            return slot
        taken = set(self.resident.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(i for i in self.resident if i not in used)
            slot = self.resident.pop(victim)
            self.adapters.pop(victim, None)
            logger.debug("LoRA adapter %d evicted from slot %d", victim, slot)
        self._load_into(adapter_id, slot)
        self.resident[adapter_id] = slot
        return slot

    def _load_into(self, adapter_id: int, slot: int) -> None:
        adapter = self._host_adapter(adapter_id)
        for slots in self._all_slots():
            slots.clear_slot(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            slots, linear, part = self.targets[layer, module]
            for name, a_rank, b_rank in rank_parts(linear, part, a, b):
                slots.set_part(slot, name, a_rank.to(self.device, self.dtype),
                               b_rank.to(self.device, self.dtype))  # fmt: skip
        self.adapters[adapter_id] = adapter

    def _host_adapter(self, adapter_id: int) -> LoRAAdapter:
        adapter = self.host.get(adapter_id)
        if adapter is not None:
            self.host.move_to_end(adapter_id)
            return adapter
        path = self.paths[adapter_id]
        adapter = load_adapter(path, self.shapes, self.config.max_lora_rank)
        logger.info("LoRA adapter %d loaded from %s (rank %d)", adapter_id, path, adapter.rank)
        self.host[adapter_id] = adapter
        self._evict_host(keep=adapter_id)
        return adapter

    def _evict_host(self, keep: int) -> None:
        """Least recently used adapters out of the host cache, down to its size, but never
        one an unfinished request (running, waiting or preempted) uses: a step never reads a
        folder, which may be gone since."""
        in_use = {keep, *self.requests.values(), *self.live}
        for victim in [i for i in self.host if i not in in_use]:
            if len(self.host) <= self.config.host_cache_size:
                return
            del self.host[victim]
