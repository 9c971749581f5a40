"""The caller's check of a request's LoRA adapter, before the request is queued.

An adapter is read and checked against the base model once per (id, path) (`pagellm.lora.peft`);
a bad one is a `ValueError` naming its module, so that request fails alone and nothing reaches
the core. A `lora_path` that is no folder here but a Hub id (`org/name`) is resolved as models
are (`pagellm.loader.hub`: the Hugging Face cache, downloading its adapter files unless
HF_HUB_OFFLINE), and the request goes on with the snapshot's folder. The runner reads the same
folder again when it loads the adapter into a slot.
"""

from __future__ import annotations

import os
import re

from pagellm.config import ModelConfig
from pagellm.config.lora import LoRAConfig
from pagellm.lora.peft import Shapes, base_model_shapes, load_adapter
from pagellm.lora.request import LoRARequest


class LoRACheck:
    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig | None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self.checked: dict[int, str] = {}  # adapter id -> its folder, checked
        self.folders: dict[str, str] = {}  # a Hub id given -> its snapshot folder
        self._shapes: Shapes | None = None  # the base model's targets, built on first use

    def __call__(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The request to queue: `lora_request`, or a copy naming its Hub id's folder."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request)}")
        if self.lora_config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} given, but LoRA is off: start the "
                "engine with enable_lora=True (--enable-lora)"
            )
        folder = self._folder(lora_request.lora_path)
        known = self.checked.get(lora_request.lora_int_id)
        if known is not None and known != folder:
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} is adapter {known!r} already; "
                f"give {lora_request.lora_path!r} another id"
            )
        if known is None:
            if self._shapes is None:
                mc = self.model_config
                self._shapes = base_model_shapes(mc.architecture, mc.hf_config)
            load_adapter(folder, self._shapes, self.lora_config.max_lora_rank)
            self.checked[lora_request.lora_int_id] = folder
        if folder == lora_request.lora_path:
            return lora_request
        return LoRARequest(lora_request.lora_name, lora_request.lora_int_id, folder)

    def _folder(self, path: str) -> str:
        """`path`, or the snapshot folder of the Hub id it is (no such folder here)."""
        if not _HUB_ID.fullmatch(path):
            return path
        if path in self.folders:
            return self.folders[path]
        if os.path.isdir(os.path.expanduser(path)):
            return path
        from pagellm.loader.hub import HubModelNotFound, download_adapter

        try:
            self.folders[path] = download_adapter(path)
        except HubModelNotFound as e:
            raise ValueError(f"LoRA adapter {path!r}: no such folder, and as a Hub id: "
                             f"{e}") from None  # fmt: skip
        return self.folders[path]

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its id may name another folder next time."""
        self.checked.pop(lora_int_id, None)


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name, as a Hub repo id is written
