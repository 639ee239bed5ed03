"""How much of the socket-free request path is one slice's, by timing everything else.

    .venv/bin/python bench/request_path_others.py [--stream]
    PYTHONPATH=/other/src .venv/bin/python bench/request_path_others.py   # another checkout

Runs `request_path_cpu.measure` with the calls the Director, flow control and the
bookkeeping make into other slices wrapped in timers: scheduling (`schedule`,
`pre_request`, `response_complete`), latency (`admit`, `dispatch`, `Ticket.done`),
routing's metrics (`observe_pick`, `scheduled`), the decision log, the tokeniser's
`needs_prepare` and `prepare`, the pool's in-flight counts and the runtime's (not its
candidate lists: which of them to read is the slice's choice), the proxy
(`forward_headers`, `Proxy.forward` with its relay, the sink and the transport) and the
P/D check. The slice's cost is the total less what the timers hold, with the timers'
own cost (measured on a wrapped no-op: in all, and the part a timer holds) taken off
both, and less the bench loop's own cost (its sink, body reader and loop turn, timed
with a `serve_inference` that only reads the body). The total is CPU (`process_time`)
over the timed part of `measure`, the run with the smallest total of `--repeats`; the
timers read `perf_counter` (cheaper; the same on a core nothing else takes). Benchmark
only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import request_path_cpu

SPENT = [0.0, 0]
"""Seconds inside wrapped calls (outermost only), and how many wrapped calls ran."""
_depth = [0]


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            _depth[0] += 1
            t0 = clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                _depth[0] -= 1
                if not _depth[0]:
                    SPENT[0] += clock() - t0
                SPENT[1] += 1

        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _depth[0] += 1
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            if not _depth[0]:
                SPENT[0] += clock() - t0
            SPENT[1] += 1

    return wrapped


def wrap_others() -> None:
    from servegate.gateway import cache_routing, disagg, inference, latency, metrics, pools, ui
    from servegate.gateway import proxy as proxy_module
    from servegate.pool import pool
    from servegate.scheduling import scheduler

    targets: list[tuple[Any, str]] = [
        (scheduler.Scheduler, "schedule"),
        (scheduler.Scheduler, "pre_request"),
        (scheduler.Scheduler, "response_complete"),
        (latency.LatencyRouting, "admit"),
        (latency.LatencyRouting, "dispatch"),
        (latency.Ticket, "done"),
        (metrics.GatewayMetrics, "observe_pick"),
        (metrics.GatewayMetrics, "scheduled"),
        (ui.DecisionLog, "record"),
        (pool.Pool, "acquire"),
        (pool.Pool, "release"),
        (pools.PoolRuntime, "enter"),
        (pools.PoolRuntime, "leave"),
        (proxy_module.Proxy, "forward"),
        (inference, "forward_headers"),
        (disagg.Disaggregator, "handles"),
    ]
    routing = getattr(cache_routing.CacheRouting, "needs_prepare", None)
    if routing is not None:
        targets.append((cache_routing.CacheRouting, "needs_prepare"))
    targets.append((cache_routing.CacheRouting, "prepare"))
    for owner, name in targets:
        raw = inspect.getattr_static(owner, name)
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(timed(raw.__func__)))
        else:
            setattr(owner, name, timed(raw))


def timer_cost() -> tuple[float, float]:
    """Seconds one wrapped call adds in all, and the part of them its own timer holds
    (timed on a wrapped no-op, less the no-op)."""

    def noop() -> None:
        return None

    wrapped = timed(noop)
    n = 200_000
    best = []
    held = []
    for f in (noop, wrapped):
        runs = []
        for _ in range(5):
            SPENT[0] = 0.0
            t0 = time.process_time()
            for _ in range(n):
                f()
            runs.append(time.process_time() - t0)
        held.append(SPENT[0] / n)
        best.append(min(runs) / n)
    SPENT[0] = 0.0
    SPENT[1] = 0
    return best[1] - best[0], held[1] - best[0]


class _TimedPart:
    """`request_path_cpu`'s clock: its first reading starts the timed part (the timers
    are zeroed), its second ends it (what they hold is kept)."""

    def __init__(self) -> None:
        self.readings = 0
        self.held = (0.0, 0)

    def process_time(self) -> float:
        self.readings += 1
        if self.readings == 1:
            SPENT[0] = 0.0
            SPENT[1] = 0
        elif self.readings == 2:
            self.held = (SPENT[0], SPENT[1])
        return time.process_time()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


async def measure(requests: int, repeats: int, stream: bool) -> tuple[float, float, float]:
    """(total, others, timed calls) per request, from the run with the smallest total."""
    best: tuple[float, float, float] | None = None
    for _ in range(repeats):
        clock = _TimedPart()
        request_path_cpu.time = clock  # type: ignore[assignment]
        total_us, _ = await request_path_cpu.measure(requests, 1, stream)
        others, calls = clock.held
        row = (total_us, others / requests * 1e6, calls / requests)
        if best is None or row[0] < best[0]:
            best = row
    assert best is not None
    return best


async def harness(requests: int, repeats: int, stream: bool) -> float:
    """The bench loop's own cost per request (its sink, body reader and loop turn), with a
    `serve_inference` that only reads the body."""
    from servegate.gateway import inference

    real = inference.serve_inference

    async def read_only(*args: Any, **kwargs: Any) -> None:
        await args[6](None)

    inference.serve_inference = read_only  # type: ignore[assignment]
    request_path_cpu.time = time  # type: ignore[assignment]
    try:
        runs = [(await request_path_cpu.measure(requests, 1, stream))[0] for _ in range(repeats)]
    finally:
        inference.serve_inference = real
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cost, inside = timer_cost()
    wrap_others()
    with asyncio.Runner(loop_factory=request_path_cpu.loop_factory()) as runner:
        total, others, calls = runner.run(measure(args.requests, args.repeats, args.stream))
        loop = runner.run(harness(args.requests, args.repeats, args.stream))
    slice_us = total - calls * cost * 1e6 - (others - calls * inside * 1e6) - loop
    print(
        f"total {total:.1f} µs with {calls:.1f} timed calls per request ({cost * 1e9:.0f} ns "
        f"each, {inside * 1e9:.0f} of them inside the timer); others {others:.1f} µs as "
        f"timed; the bench loop {loop:.1f} µs; the slice {slice_us:.1f} µs per request"
    )


if __name__ == "__main__":
    main()
