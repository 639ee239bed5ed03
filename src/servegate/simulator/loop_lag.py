"""Event-loop lag: how late a periodic timer fires, the figure that shows an overloaded process.

A task sleeps `interval_s` and records by how much the wake-up overshot, and how
much CPU the process used meanwhile (a late wake-up with little CPU used means the
process was waiting for a core, not blocking its loop); a GC callback records
collector pauses.
Reported by `GET /admin/loop_lag` (reset by `POST /admin/loop_lag`) with the
process's resident memory, so the capacity benchmark can read all from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
import statistics
import time
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
        self.gc_pauses: deque[float] = deque(maxlen=keep)
        self._gc_started = 0.0
        self._worst = (0.0, 0.0)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-loop-lag")
            gc.callbacks.append(self._on_gc)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_gc)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def reset(self) -> None:
        self.samples.clear()
        self.gc_pauses.clear()
        self._worst = (0.0, 0.0)

    def summary(self) -> dict[str, float | int]:
        data = sorted(self.samples)
        pauses = list(self.gc_pauses)
        return {
            "samples": len(data),
            "median_ms": statistics.median(data) * 1000 if data else 0.0,
            "p99_ms": data[min(len(data) - 1, int(len(data) * 0.99))] * 1000 if data else 0.0,
            "max_ms": data[-1] * 1000 if data else 0.0,
            "max_lag_cpu_ms": self._worst[1] * 1000,
            "gc_collections": len(pauses),
            "gc_max_ms": max(pauses, default=0.0) * 1000,
            "rss_bytes": rss_bytes(),
        }

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.gc_pauses.append(time.perf_counter() - self._gc_started)
            self._gc_started = 0.0

    async def _run(self) -> None:
        clock, cpu = time.perf_counter, time.process_time
        while True:
            before, cpu_before = clock(), cpu()
            await asyncio.sleep(self.interval_s)
            late = max(0.0, clock() - before - self.interval_s)
            self.samples.append(late)
            if late > self._worst[0]:
                self._worst = (late, cpu() - cpu_before)
