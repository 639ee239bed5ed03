"""`Deadlines`: when each upstream exchange must end, checked without a loop timer apiece.

Why: an exchange's deadlines (`first_byte_timeout_s`, 300 s by default, and
`total_timeout_s`) are minutes away and almost never reached, yet a `call_at` timer per
request, cancelled when the answer ends, costs ~1 µs of a tight loop and more in the
server (a heap push, a handle, a cancel). A deadline at least `far` seconds away goes into
one dict instead, swept every `grain` seconds while it holds any: such a deadline fires at
most `grain` late, a tenth of its length at the defaults. A nearer deadline (a small
configured timeout, or the total one once the first byte came late) keeps its own exact
timer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

GRAIN_S = 1.0
"""How often far deadlines are checked, so how late one may fire."""
FAR_S = 10.0
"""A deadline at least this far off is swept; a nearer one gets its own timer."""


class Deadlines:
    """The far deadlines of one transport's exchanges; `arm` chooses sweep or timer."""

    __slots__ = ("_far", "_grain", "_loop", "_sweeper", "far_s")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, grain_s: float = GRAIN_S, far_s: float = FAR_S
    ) -> None:
        self._loop = loop
        self._grain = grain_s
        self.far_s = far_s
        self._far: dict[object, tuple[float, Callable[[], None]]] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def arm(
        self, key: object, when: float, expire: Callable[[], None]
    ) -> asyncio.TimerHandle | None:
        """Call `expire` once `when` (loop time) has passed, unless `disarm(key)` comes first.
        Returns the exact timer for a near deadline (the caller cancels it), None when the
        deadline is swept."""
        loop = self._loop
        if when - loop.time() < self.far_s:
            return loop.call_at(when, expire)
        self._far[key] = (when, expire)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._grain, self._sweep)
        return None

    def disarm(self, key: object) -> None:
        self._far.pop(key, None)

    def __len__(self) -> int:
        return len(self._far)

    def close(self) -> None:
        """Stop sweeping; the deadlines left are dropped (their exchanges are being closed)."""
        self._far.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep(self) -> None:
        self._sweeper = None
        now = self._loop.time()
        far = self._far
        due = [key for key, (when, _) in far.items() if when <= now]
        for key in due:
            entry = far.pop(key, None)
            if entry is not None:
                entry[1]()  # may arm again (the total deadline after the first byte)
        if far and self._sweeper is None:
            self._sweeper = self._loop.call_later(self._grain, self._sweep)
