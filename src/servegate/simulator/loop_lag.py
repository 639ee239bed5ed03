"""Event-loop lag: how late a periodic timer fires, the figure that shows an overloaded process.

A task sleeps `interval_s` and records by how much the wake-up overshot. Reported
by `GET /admin/loop_lag` (and reset by `POST /admin/loop_lag`) with the process's
resident memory, so the capacity benchmark can read both from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import statistics
from collections import deque


def rss_bytes() -> int:
    """Current resident set size (Linux `/proc`; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.05, keep: int = 100_000) -> None:
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def reset(self) -> None:
        self.samples.clear()

    def summary(self) -> dict[str, float | int]:
        data = sorted(self.samples)
        if not data:
            return {
                "samples": 0,
                "median_ms": 0.0,
                "p99_ms": 0.0,
                "max_ms": 0.0,
                "rss_bytes": rss_bytes(),
            }
        return {
            "samples": len(data),
            "median_ms": statistics.median(data) * 1000,
            "p99_ms": data[min(len(data) - 1, int(len(data) * 0.99))] * 1000,
            "max_ms": data[-1] * 1000,
            "rss_bytes": rss_bytes(),
        }

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, loop.time() - before - self.interval_s))
