"""SpareCore: an EngineCore process started ahead of need, so that replacing a dead core is a
hand-over instead of a cold start (`pagellm serve --restart-engine`, `--engine-spare`).

A restart's cold start is mostly the core's own start-up: the interpreter and its imports
(torch, the kernels), then the model's weights read, converted and packed for the CPU's GEMMs
(docs/notes.md, restarting a dead engine core). A spare has done that part already:
- "loaded": the whole EngineCore is built (weights packed, KV cache allocated) and waits, idle,
  for requests that only come once it is handed over. It costs a second core's memory (its
  weights; the CPU's KV cache is only reserved, its pages taken as they are first written) and,
  while it loads, CPU time beside the serving core.
- "imported": the process has imported torch and pagellm and waits for its config; handed
  over, it loads the model then. For CUDA, where the serving core holds the GPU's memory and a
  second copy of the model cannot wait there.
"auto" is "loaded" on the CPU and "imported" elsewhere; "none" keeps no spare. After a
hand-over the next spare starts a few seconds later (`AsyncLLM`, SPARE_DELAY_S), once the new
core has served its first requests.

The spare is a child of the server like the serving core (an `AsyncMPClient` started early):
it exits with the server, even after SIGKILL (its parent watchdog, or EOF on its stdin while it
waits for its config), and it is started after the serving core, so the oldest child is the one
that serves.
"""

from __future__ import annotations

import asyncio
import logging

from pagellm.config import EngineConfig
from pagellm.engine.core_client import AsyncMPClient

logger = logging.getLogger(__name__)


def resolve_spare(spare: str, device: str) -> str:
    """`--engine-spare` for this device: "loaded", "imported" or "none"."""
    if spare == "auto":
        return "loaded" if device == "cpu" else "imported"
    return spare


class SpareCore:
    def __init__(self, config: EngineConfig, loaded: bool, env: dict[str, str]) -> None:
        """Starts the process; `loaded`: it builds the EngineCore now. `env`: its environment
        beside the server's (the first core's CPU GEMM plan)."""
        self.config = config
        self.client: AsyncMPClient | None = AsyncMPClient(env)
        self.ready: asyncio.Task | None = None
        logger.info(
            "spare engine core %d started (%s)", self.client.proc.pid,
            "loading the model" if loaded else "imports only",
        )  # fmt: skip
        if loaded:
            self._load()

    def _load(self) -> None:
        self.client.start_core(self.config)
        self.ready = asyncio.create_task(self.client.wait_for_ready_async())
        self.ready.add_done_callback(self._loaded)

    def _loaded(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            logger.warning("the spare engine core did not start: %s", task.exception())
        else:
            logger.info("spare engine core %d ready", task.result().pid)

    async def take(self) -> AsyncMPClient:
        """The spare as a ready client, loading it first if it only imported (or has not
        finished loading). Raises if it died or did not start; it is then shut down."""
        try:
            if self.ready is None:
                self._load()
            await self.ready
            if not self.client.is_alive():
                raise RuntimeError(f"exited with code {self.client.proc.poll()}")
        except BaseException:
            self.shutdown()
            raise
        client, self.client = self.client, None
        return client

    def shutdown(self) -> None:
        if self.ready is not None:
            self.ready.cancel()
        if self.client is not None:
            self.client.shutdown()
            self.client = None
