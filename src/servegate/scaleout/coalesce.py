"""One timer per sharing stream: changes within `delay_s` of the first go out in one message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Coalescer:
    """Calls `flush` once, `delay_s` after the first `poke` since the last call."""

    __slots__ = ("_flush", "_handle", "delay_s")

    def __init__(self, delay_s: float, flush: Callable[[], None]) -> None:
        self.delay_s = delay_s
        self._flush = flush
        self._handle: asyncio.TimerHandle | None = None

    def poke(self) -> None:
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.delay_s, self.now)

    def now(self) -> None:
        """Flush at once (a full batch, or the timer firing)."""
        self.cancel()
        self._flush()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
