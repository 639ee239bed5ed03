"""A histogram child as plain numbers: a count per bucket and the sum.

The request path observes on the event loop only, so a child needs no lock; a stream's
inter-chunk gaps are counted into one of these on the request's own record and merged
into the family when the request ends, so a long stream costs a fixed few counters
rather than a list that grows with every chunk.
"""

from __future__ import annotations

from bisect import bisect_left

TPOT_BUCKETS = (
    0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.6, 0.8, 1, 2,
)  # fmt: skip


class Buckets:
    """One histogram child: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def merge(self, other: Buckets) -> None:
        """Add `other`'s observations (same bounds)."""
        counts = self.counts
        for index, count in enumerate(other.counts):
            if count:
                counts[index] += count
        self.sum += other.sum

    @property
    def count(self) -> int:
        return sum(self.counts)
