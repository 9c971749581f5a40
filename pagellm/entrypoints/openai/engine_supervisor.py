"""EngineSupervisor: what the server does when its EngineCore dies.

Requests in flight fail at once (AsyncLLM hands each one EngineDeadError: a 503). Then, by
default, the server exits with status 1 within a few seconds, so that whatever supervises it
(systemd, Docker, Kubernetes) starts it again: vLLM's behaviour. With `--restart-engine` a new
EngineCore takes over in place instead: the spare the engine keeps (`--engine-spare`,
`SpareCore`), or a new process; until it serves, requests get 503 with Retry-After and
`/health` says "restarting". More than `max_restarts` deaths within a minute mean something is
wrong with every core (the model, the machine): the server exits then too.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from pagellm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_WINDOW_S = 60.0
_ANSWER_S = 0.5  # time for in-flight requests to get their 503 out before the server stops


class EngineSupervisor:
    def __init__(
        self,
        engine: AsyncLLM,
        request_exit: Callable[[int], None],
        restart: bool = False,
        max_restarts: int = 3,  # per minute
        on_restart: Callable[[], None] | None = None,
        spare: str = "none",  # the engine's spare core with `restart` (AsyncLLM.keep_spare)
    ) -> None:
        self.engine = engine
        self.spare = spare
        self.request_exit = request_exit
        self.restart = restart
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.restarting = False
        self.num_restarts = 0
        self._recent: collections.deque[float] = collections.deque()  # restart times

    async def run(self) -> None:
        if self.restart and self.spare != "none":
            self.engine.keep_spare(self.spare)
        while True:
            error = await self.engine.wait_dead()
            logger.error("the engine core died: %s", error)
            if not (self.restart and self._may_restart()):
                await asyncio.sleep(_ANSWER_S)
                logger.error("pagellm serve: exiting with status 1 (the engine core is dead)")
                self.request_exit(1)
                return
            if not await self._restart():
                self.request_exit(1)
                return

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._recent and now - self._recent[0] > _WINDOW_S:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            logger.error("%d engine restarts within a minute: giving up", len(self._recent))
            return False
        self._recent.append(now)
        return True

    async def _restart(self) -> bool:
        logger.warning("starting a new engine core (restart %d)", self.num_restarts + 1)
        self.restarting = True
        start = time.perf_counter()
        try:
            await self.engine.restart_engine_core()
        except Exception:
            logger.exception("the new engine core did not start")
            return False
        finally:
            self.restarting = False
        self.num_restarts += 1
        if self.on_restart is not None:
            self.on_restart()
        logger.warning("engine core restarted in %.1f s", time.perf_counter() - start)
        return True
