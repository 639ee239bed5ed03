"""`pool.latency:` in servegate's YAML: how the pool's latency predictor learns.

    pool:
      latency:
        learn_per_s: 100    # streams learned per second and endpoint; null or 0: every one

Above the cap the predictor learns `learn_per_s` streams a second per endpoint, spread
evenly, and skips the rest (`LatencyPredictor.sample`); below it nothing changes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from servegate.scheduling.latency.predictor import LEARN_PER_S, LatencyPredictor


class LatencySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    learn_per_s: float | None = Field(LEARN_PER_S, ge=0)
    """The most streams per second each endpoint's models learn from; null or 0: every
    stream (each costs four statistics updates and solves, ~10 µs apiece)."""

    def predictor(self) -> LatencyPredictor:
        """A fresh predictor with these settings."""
        return LatencyPredictor(learn_per_s=self.learn_per_s)
