"""Retries before the first byte: a budget so they cannot multiply an outage, and jittered backoff.

The budget follows Finagle's: over a sliding window, retries may add at most
`budget_percent` of the requests seen, plus a floor of `min_retries_per_s` so
a quiet gateway can still retry. When a replica dies under load every request
in flight fails at once; without a budget each would be retried at once too,
doubling the load on the replicas that are left exactly when they can least
take it. Backoff before retry k is uniform in [0, min(backoff_max_s,
backoff_base_s x 2^(k-1))] ("full jitter").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from servegate.config import RetrySettings


class RetryBudget:
    def __init__(
        self,
        settings: RetrySettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings or RetrySettings()
        self._clock = clock
        self._rng = rng or random.Random()
        self._slots = max(1, int(self.settings.window_s))
        self._slot_s = self.settings.window_s / self._slots
        self._requests = [0] * self._slots
        self._retries = [0] * self._slots
        self._epoch = [0] * self._slots
        self.exhausted = 0
        """Retries refused because the budget was spent."""

    def _slot(self) -> int:
        tick = int(self._clock() / self._slot_s)
        index = tick % self._slots
        if self._epoch[index] != tick:
            self._epoch[index] = tick
            self._requests[index] = 0
            self._retries[index] = 0
        return index

    def _live(self, counts: list[int]) -> int:
        tick = int(self._clock() / self._slot_s)
        return sum(c for c, e in zip(counts, self._epoch, strict=True) if tick - e < self._slots)

    def request(self) -> None:
        """One request arrived (its first attempt)."""
        self._requests[self._slot()] += 1

    def try_retry(self) -> bool:
        """Spend one retry if the budget allows; False (and counted) when it does not."""
        index = self._slot()
        s = self.settings
        allowed = s.min_retries_per_s * s.window_s + s.budget_percent / 100.0 * self._live(
            self._requests
        )
        if self._live(self._retries) + 1 > allowed:
            self.exhausted += 1
            return False
        self._retries[index] += 1
        return True

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        s = self.settings
        cap = min(s.backoff_max_s, s.backoff_base_s * (2 ** max(0, retry - 1)))
        return self._rng.uniform(0.0, cap) if cap > 0 else 0.0
