"""Wall-time bounds that hold on a loaded machine (issue 36).

A test that promises an event within `seconds` on an idle machine allows `seconds` times the
slowdown measured in the same test, around the event: the wall time this process takes for a
fixed amount of CPU work over that CPU time (1 on an idle machine; about the number of
runnable tasks per core when they share it). The scheduler gives each process about the same
share, so the engine core, the server and the test's own threads are slowed alike. On an
idle machine the bound is the promise itself, so a test still fails where the promise breaks.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

SLOWDOWN_CPU_S = 0.02  # CPU work per measurement (a few scheduler slices)


def slowdown() -> float:
    """Wall time over CPU time of a short busy loop in this thread, at least 1."""
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu < SLOWDOWN_CPU_S:
        pass
    return max(1.0, (time.perf_counter() - wall) / (time.thread_time() - cpu))


def scaled(seconds: float, before: float = 1.0) -> float:
    """`seconds` times the slowdown now, or `before` (measured before the event) if larger."""
    return seconds * max(before, slowdown())


def wait_until(condition: Callable[[], bool], seconds: float, interval: float = 0.05) -> bool:
    """Polls `condition` until it holds (True) or `seconds`, scaled by the slowdown at the
    start and again at the deadline, have passed (False)."""
    start, before = time.monotonic(), slowdown()
    while not condition():
        if time.monotonic() - start > seconds * before:
            before = max(before, slowdown())
            if time.monotonic() - start > seconds * before:
                return condition()
        time.sleep(interval)
    return True


async def async_wait_until(
    condition: Callable[[], bool | Awaitable[bool]], seconds: float, interval: float = 0.01
) -> bool:
    """`wait_until` in an event loop; `condition` may be a coroutine function."""

    async def holds() -> bool:
        result = condition()
        return await result if inspect.isawaitable(result) else result

    start, before = time.monotonic(), slowdown()
    while not await holds():
        if time.monotonic() - start > seconds * before:
            before = max(before, slowdown())
            if time.monotonic() - start > seconds * before:
                return await holds()
        await asyncio.sleep(interval)
    return True
