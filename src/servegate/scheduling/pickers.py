"""Pickers: turn per-endpoint total scores into a preference order.

The first endpoint returned is the target, the rest are fallbacks for retries.
All randomness comes from `cycle.rng`, so a seeded cycle is reproducible.
`round-robin-picker` keeps no counter of its own: it reads when each endpoint was
last picked, which the pool records at dispatch.

`maxNumOfEndpoints` caps how many endpoints a picker returns, as in llm-d. Its
default differs on purpose: llm-d returns 1 unless told otherwise; servegate
returns every candidate, because the gateway retries around a failed replica
using the fallbacks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from random import Random
from typing import Any, ClassVar, Self

from pydantic import Field

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest


class PickerParameters(Parameters):
    max_num_of_endpoints: int | None = Field(None, alias="maxNumOfEndpoints", gt=0)


class _Picker:
    __slots__ = ("max_num_of_endpoints", "name")
    type: ClassVar[str]

    def __init__(self, name: str | None = None, max_num_of_endpoints: int | None = None) -> None:
        self.name = name or self.type
        self.max_num_of_endpoints = max_num_of_endpoints

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(PickerParameters, cls.type, name, parameters)
        return cls(name, p.max_num_of_endpoints)

    def _limit(self, n: int) -> int:
        k = self.max_num_of_endpoints
        return n if k is None or k > n else k

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class MaxScorePicker(_Picker):
    """Highest total first; ties for first place broken uniformly at random.

    Fallbacks follow in descending score; equal scores among them are ordered
    from a random starting offset rather than by position in the pool.
    """

    __slots__ = ()
    type: ClassVar[str] = "max-score-picker"

    def pick(
        self,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        scores: list[float],
    ) -> list[EndpointState]:
        n = len(endpoints)
        if n <= 1:
            return list(endpoints)
        rng = cycle.rng
        k = self._limit(n)
        if k == 1:
            best = max(scores)
            ties = [i for i, s in enumerate(scores) if s == best]
            return [endpoints[ties[rng.randrange(len(ties))] if len(ties) > 1 else ties[0]]]
        if n == 2 and k == 2:
            # what the general path does for two: the stable descending sort keeps the
            # order from `offset` unless the second scores higher (`<`, so NaN keeps it)
            offset = _coin(rng)
            a, b = (0, 1) if offset == 0 else (1, 0)
            if scores[a] < scores[b]:
                a, b = b, a
            if scores[b] == scores[a] and _coin(rng):
                a, b = b, a
            return [endpoints[a], endpoints[b]]
        offset = rng.randrange(n)
        order = list(range(offset, n))
        order.extend(range(offset))
        order.sort(key=scores.__getitem__, reverse=True)
        best = scores[order[0]]
        tied = 1
        while tied < n and scores[order[tied]] == best:
            tied += 1
        if tied > 1:
            j = rng.randrange(tied)
            order[0], order[j] = order[j], order[0]
        if k < n:
            del order[k:]
        return list(map(endpoints.__getitem__, order))


def _coin(rng: Random) -> int:
    """`rng.randrange(2)`, the same draw: for `random.Random` itself, its
    `_randbelow_with_getrandbits(2)` written out (two bits, again while they make 2 or 3),
    without the two Python calls in between."""
    if type(rng) is not Random:
        return rng.randrange(2)
    r = rng.getrandbits(2)
    while r >= 2:
        r = rng.getrandbits(2)
    return r


class RandomPicker(_Picker):
    """Uniformly random order, ignoring scores."""

    __slots__ = ()
    type: ClassVar[str] = "random-picker"

    def pick(
        self,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        scores: list[float],
    ) -> list[EndpointState]:
        n = len(endpoints)
        if n <= 1:
            return list(endpoints)
        k = self._limit(n)
        if k == 1:
            return [endpoints[cycle.rng.randrange(n)]]
        return cycle.rng.sample(endpoints, k)


class WeightedRandomPicker(_Picker):
    """Random order where each next endpoint is drawn with probability ∝ its score.

    Weighted sampling without replacement (Efraimidis-Spirakis A-Res): each
    endpoint with score w > 0 gets the key `U^(1/w)` (computed as `ln(U)/w`),
    and endpoints are ranked by key. Endpoints scoring 0 come last in random
    order; when every score is 0 the order is uniformly random.
    """

    __slots__ = ()
    type: ClassVar[str] = "weighted-random-picker"

    def pick(
        self,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        scores: list[float],
    ) -> list[EndpointState]:
        n = len(endpoints)
        if n <= 1:
            return list(endpoints)
        rng = cycle.rng
        k = self._limit(n)
        positive = [i for i, w in enumerate(scores) if w > 0.0]
        random = rng.random
        log = math.log
        keys = {i: log(1.0 - random()) / scores[i] for i in positive}
        order = sorted(positive, key=keys.__getitem__, reverse=True)
        if len(order) < k:
            zeros = [i for i, w in enumerate(scores) if not w > 0.0]
            rng.shuffle(zeros)
            order.extend(zeros)
        return [endpoints[i] for i in order[:k]]


class RoundRobinPicker(_Picker):
    """Least recently picked first, ignoring scores: a rotation over the candidates.

    Orders candidates by `last_picked_at` (set by the pool when the gateway
    dispatches), oldest first, ties by address. Because the pool stamps the chosen
    endpoint before the next request is scheduled, successive requests walk the
    candidates in turn; an endpoint that joins the pool is never picked yet and
    goes first once. The baseline for comparing routing policies.
    """

    __slots__ = ()
    type: ClassVar[str] = "round-robin-picker"

    def pick(
        self,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        scores: list[float],
    ) -> list[EndpointState]:
        if len(endpoints) <= 1:
            return list(endpoints)
        order = sorted(endpoints, key=_last_picked)
        return order[: self._limit(len(order))]


def _last_picked(state: EndpointState) -> tuple[float, str]:
    return state.last_picked_at, state.endpoint.address
