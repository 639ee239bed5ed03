"""llm-d's admitters: refuse a request before it is scheduled.

`probabilistic-admitter` sheds sheddable traffic (priority < 0) with a
probability that rises steeply with the pool's saturation, while priority ≥ 0 is
always admitted. Per endpoint the saturation is the larger of `waiting /
queueDepthThreshold` and `kv_usage / kvCacheUtilThreshold` (an endpoint with no
metrics yet counts as 1); the pool's is their mean; a request is refused with
probability `min(1, k · saturation^power)`. The gateway asks every admitter
before flow control (`gateway/admission.py`) and answers a refusal with 429.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

from pydantic import Field

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters

ADMITTER_KIND = "admitter"


@runtime_checkable
class Admitter(Protocol):
    name: str

    def refusal(
        self, priority: int, endpoints: Sequence[EndpointState], rng: random.Random
    ) -> str | None:
        """None to admit; else why the request is refused."""
        ...


class ProbabilisticParameters(Parameters):
    queue_depth_threshold: int = Field(5, alias="queueDepthThreshold", gt=0)
    kv_cache_util_threshold: float = Field(0.8, alias="kvCacheUtilThreshold", gt=0.0, le=1.0)
    power: float = Field(5.0, gt=0.0)
    k: float = Field(300.0, gt=0.0)


class ProbabilisticAdmitter:
    """`probabilistic-admitter`: sheds priority < 0 requests with probability k·sat^power."""

    __slots__ = ("name", "params")
    type: ClassVar[str] = "probabilistic-admitter"
    kind: ClassVar[str] = ADMITTER_KIND

    def __init__(self, name: str, params: ProbabilisticParameters) -> None:
        self.name = name
        self.params = params

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(ProbabilisticParameters, cls.type, name, parameters))

    def saturation(self, endpoints: Sequence[EndpointState]) -> float:
        if not endpoints:
            return 0.0
        p = self.params
        total = 0.0
        for state in endpoints:
            m = state.metrics
            if m.scraped_at <= 0.0:
                total += 1.0
                continue
            total += max(
                m.waiting / p.queue_depth_threshold, m.kv_usage / p.kv_cache_util_threshold
            )
        return total / len(endpoints)

    def shed_probability(self, saturation: float) -> float:
        chance: float = self.params.k * saturation**self.params.power
        return min(1.0, chance)

    def refusal(
        self, priority: int, endpoints: Sequence[EndpointState], rng: random.Random
    ) -> str | None:
        if priority >= 0 or not endpoints:
            return None
        sat = self.saturation(endpoints)
        chance = self.shed_probability(sat)
        if chance > 0.0 and rng.random() < chance:
            return (
                f"sheddable request (priority {priority}) refused by {self.name!r}: pool "
                f"saturation {sat:.2f}, shed probability {chance:.2f}"
            )
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
