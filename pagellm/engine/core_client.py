"""EngineCoreClient: how the caller side talks to an EngineCore.

`InprocClient` calls EngineCore directly in this process (PAGELLM_ENABLE_MULTIPROCESSING=0).
Everything a client sends is data a msgspec struct can carry, so the same calls work
across a process boundary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """add_request / abort_requests go in; get_output() returns what the core produced."""

    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The outputs of the next engine step (may be empty when nothing is running)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a named EngineCore utility (e.g. get_num_free_blocks) and return its result."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int: ...


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from pagellm.engine.core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    @property
    def num_kv_blocks(self) -> int:
        return self.engine_core.num_kv_blocks
