"""The caller's check of a request's LoRA adapter, before the request is queued.

An adapter is read and checked against the base model once per (id, path) (`pagellm.lora.peft`);
a bad one is a `ValueError` naming its module, so that request fails alone and nothing reaches
the core. The runner reads the same folder again when it loads the adapter into a slot.
"""

from __future__ import annotations

from pagellm.config import ModelConfig
from pagellm.config.lora import LoRAConfig
from pagellm.lora.peft import Shapes, base_model_shapes, load_adapter
from pagellm.lora.request import LoRARequest


class LoRACheck:
    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig | None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self.checked: dict[int, str] = {}  # adapter id -> its path, checked
        self._shapes: Shapes | None = None  # the base model's targets, built on first use

    def __call__(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request)}")
        if self.lora_config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} given, but LoRA is off: start the "
                "engine with enable_lora=True (--enable-lora)"
            )
        known = self.checked.get(lora_request.lora_int_id)
        if known == lora_request.lora_path:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} is adapter {known!r} already; "
                f"give {lora_request.lora_path!r} another id"
            )
        if self._shapes is None:
            mc = self.model_config
            self._shapes = base_model_shapes(mc.architecture, mc.hf_config)
        load_adapter(lora_request.lora_path, self._shapes, self.lora_config.max_lora_rank)
        self.checked[lora_request.lora_int_id] = lora_request.lora_path

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its id may name another folder next time."""
        self.checked.pop(lora_int_id, None)
