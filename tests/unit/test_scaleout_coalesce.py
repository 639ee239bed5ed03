from __future__ import annotations

import asyncio

from servegate.scaleout.coalesce import Coalescer


async def test_pokes_within_the_window_flush_once() -> None:
    calls: list[int] = []
    coalescer = Coalescer(0.01, lambda: calls.append(1))
    for _ in range(5):
        coalescer.poke()
    await asyncio.sleep(0.05)
    coalescer.poke()
    await asyncio.sleep(0.05)
    assert calls == [1, 1]  # one per window with pokes


async def test_now_flushes_and_drops_the_pending_timer() -> None:
    calls: list[int] = []
    coalescer = Coalescer(0.01, lambda: calls.append(1))
    coalescer.poke()
    coalescer.now()
    await asyncio.sleep(0.05)
    coalescer.poke()
    coalescer.cancel()
    await asyncio.sleep(0.05)
    assert calls == [1]  # the timer of the first poke and the cancelled one never fire
