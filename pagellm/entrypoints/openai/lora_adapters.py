"""The server's LoRA adapters by name (vLLM's `--lora-modules` and runtime loading).

A request's `model` field names the base model or an adapter (`LoRAAdapters.request_for`);
`/v1/models` lists each adapter with its `parent`; `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (behind the API key, with `--enable-lora`) add and remove
them at run time. An adapter is checked against the base model when it is added (its
folder read: a bad one is a 400 naming its module; at run time also read into the engine
core's host cache, as vLLM does); an unknown name is a 404.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import NonEmptyText, RequestModel
from pagellm.entrypoints.openai.response_models import ModelCard
from pagellm.lora.request import LoRARequest

lora_routes = APIRouter(prefix="/v1")
# errors are JSON where the success is text: documented so, with the shared error schema
_ERRORS = {
    code: {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    }
    for code in (400, 401, 404, 413, 415)
}


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: NonEmptyText  # it is echoed in /v1/models and replies: valid Unicode
    lora_path: NonEmptyText
    load_inplace: bool = False  # vLLM's: a name loaded already takes the new folder


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: NonEmptyText
    lora_int_id: int | None = None  # vLLM's; the name alone picks the adapter here


class LoRAAdapters:
    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.enabled = engine.config.lora_config is not None
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # load runs in worker threads: check + add are one step
        self._loading: set[str] = set()  # names whose folder is being checked now

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.adapters.get(model) if model is not None else None

    def load(self, name: str, path: str, inplace: bool = False) -> LoRARequest:
        """Check and add an adapter (`--lora-modules`, before the engine runs; ValueError: a
        400 in the server's words); `inplace`: a name loaded already takes the new folder
        (requests running under the old one finish with it)."""
        self._reserve(name, inplace)
        try:
            request = self._checked(LoRARequest(name, next(self._ids), path))
        except BaseException:
            self._release(name)
            raise
        return self._commit(request)

    async def load_now(self, name: str, path: str, inplace: bool = False) -> LoRARequest:
        """`load` at run time, and the folder read into the engine core's host cache before
        it is added (as vLLM reads it at load): a folder removed after this call does not
        fail the adapter's requests."""
        self._reserve(name, inplace)
        try:  # the folder is read outside the lock and the event loop: other names load
            request = LoRARequest(name, next(self._ids), path)
            request = await asyncio.to_thread(self._checked, request)  # a Hub id's folder
            error = await self.engine.call_utility("load_lora", name, request.lora_int_id,
                                                   request.lora_path)  # fmt: skip
            if error:
                raise ValueError(f"LoRA adapter {path!r}: {error}")
        except BaseException:
            self._release(name)
            raise
        return self._commit(request)

    async def read_all(self) -> None:
        """The adapters added before the engine ran (`--lora-modules`) read into the engine
        core's host cache, as vLLM reads them at start: their folders are not needed after
        (beyond `max_cpu_loras` adapters, the last ones stay cached)."""
        for request in list(self.adapters.values()):
            args = (request.lora_name, request.lora_int_id, request.lora_path)
            error = await self.engine.call_utility("load_lora", *args)
            if error:
                raise ValueError(f"LoRA adapter {request.lora_path!r}: {error}")

    def _reserve(self, name: str, inplace: bool) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters need the server started with --enable-lora")
        if not name:
            raise ValueError("lora_name must not be empty")
        if name in self.base_names:
            raise ValueError(f"{name!r} cannot name a LoRA adapter: it is the base model's name")
        with self._lock:
            if name in self._loading:
                raise ValueError(f"LoRA adapter {name!r} is being loaded by another request")
            if name in self.adapters and not inplace:
                raise ValueError(f"LoRA adapter {name!r} is loaded already: unload it first, "
                                 "or set load_inplace to replace it")  # fmt: skip
            self._loading.add(name)

    def _release(self, name: str) -> None:
        with self._lock:
            self._loading.discard(name)

    def _commit(self, request: LoRARequest) -> LoRARequest:
        with self._lock:
            old = self.adapters.get(request.lora_name)
            self.adapters[request.lora_name] = request
            self._loading.discard(request.lora_name)
        if old is not None:
            self.engine.input_processor.check_lora.forget(old.lora_int_id)
        return request

    def _checked(self, request: LoRARequest) -> LoRARequest:
        try:
            request = self.engine.input_processor.check_lora(request)
        except (ValueError, TypeError):
            raise
        except Exception as e:  # whatever a foreign folder raises is still its fault
            where = f"LoRA adapter {request.lora_path!r}"
            raise ValueError(f"{where}: {type(e).__name__}: {e}") from None
        return request

    def unload(self, name: str) -> None:
        request = self.adapters.pop(name, None)
        if request is None:
            raise APIError(f"The LoRA adapter `{name}` does not exist.", 404, "lora_name")
        self.engine.input_processor.check_lora.forget(request.lora_int_id)

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(id=name, root=r.lora_path, parent=self.base_names[0],
                      max_model_len=max_model_len)
            for name, r in self.adapters.items()
        ]  # fmt: skip


@lora_routes.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request) -> str:
    adapters: LoRAAdapters = raw_request.app.state.lora_adapters
    await adapters.load_now(body.lora_name, body.lora_path, body.load_inplace)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@lora_routes.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request) -> str:
    raw_request.app.state.lora_adapters.unload(body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
