"""The plugin contracts of the endpoint picker, in one place.

A scheduling cycle runs the profile handler's chosen profiles; each profile
filters the candidates, asks every scorer for a score per endpoint, clamps each
to [0, 1], multiplies by the scorer's weight, sums, and lets the picker rank the
endpoints. Plugins are pure functions of (request, endpoints, cycle); the
framework (`scheduler.py`) does clamping, weighting, timing and the decision.

Plugins that must learn what was decided (an approximate prefix index, session
bindings) also implement `PreRequest` and/or `ResponseComplete`; the gateway
calls those hooks after the decision, outside the pure scheduling call.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.request import LLMRequest


class CycleState:
    """Per-cycle inputs and scratch space: the clock and randomness come from here.

    A plain slotted class, built once per request: its `__init__` is cheaper than a
    dataclass's with a default factory.
    """

    __slots__ = ("data", "now", "rng")

    def __init__(self, now: float, rng: random.Random, data: dict[str, Any] | None = None) -> None:
        self.now = now
        self.rng = rng
        self.data: dict[str, Any] = {} if data is None else data

    def __repr__(self) -> str:
        return f"CycleState(now={self.now!r}, data={self.data!r})"


@runtime_checkable
class Plugin(Protocol):
    type: ClassVar[str]
    name: str


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]: ...


IDENTITY_ONLY = "identity_only"
"""A filter class attribute: `True` when its verdict reads only `Endpoint` identity
(labels, role), never live state or the request. The scheduler then reuses its output
while it is handed the same candidate list (`Pool.candidates` shares one list per
pool state), so a steady large pool is not re-filtered per request."""

KEEPS_FALLBACKS = "keeps_fallbacks"
"""A filter class attribute: `True` when it states a preference, not a requirement
(`prefix-cache-affinity-filter`: the replicas holding the prefix). The endpoints it
removes stay in the decision as last-resort fallbacks, after the ranked ones, so a
sticky replica that dies mid-request still has somewhere to retry. Only when no
other filter runs after it (a later filter's verdict is not known for them)."""


@runtime_checkable
class Scorer(Plugin, Protocol):
    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        """One score per endpoint, in order; the framework clamps to [0, 1]."""
        ...


@runtime_checkable
class Shortlister(Protocol):
    """A scorer that names, without a pass over the pool, the endpoints it would favour.

    Large pools are scored on a bounded shortlist (`scheduler.py`); a prefix scorer
    knows from its index which replicas hold the prompt's longest prefixes, so they
    are always on the list. `None` means "I cannot say cheaply: score everyone".
    """

    def shortlist(
        self, cycle: CycleState, request: LLMRequest, limit: int
    ) -> Collection[str] | None: ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(
        self,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        scores: list[float],
    ) -> list[EndpointState]:
        """Endpoints in preference order: the first is the target, the rest fallbacks."""
        ...


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


@dataclass(slots=True)
class SchedulerProfile:
    name: str
    filters: list[Filter]
    scorers: list[WeightedScorer]
    picker: Picker


@dataclass(slots=True)
class ProfileResult:
    """What one profile chose; `scores[address][scorer name]` is the weighted score.

    `scores` and `totals` are read-only mappings: the scheduler hands out lazy
    views (rows are built only when read) to keep per-endpoint dicts off the hot
    path; `dict(...)` them before serialising.
    """

    ranked: list[EndpointState]
    scores: Mapping[str, Mapping[str, float]]
    totals: Mapping[str, float]


@dataclass(slots=True)
class Decision:
    """The outcome of one scheduling cycle."""

    endpoint: EndpointState
    fallbacks: list[EndpointState]
    prefill: EndpointState | None = None
    profile: str = "default"
    results: dict[str, ProfileResult] = field(default_factory=dict)
    pd_decision: str | None = None
    """For P/D: which way the decider went (`prefill-decode`, `decode-only`)."""
    primary_port: int | None = None
    """Data parallelism behind a sidecar: send to this port on the chosen endpoint's host,
    naming the chosen rank (`ip:port`) in `x-data-parallel-host-port`."""
    encoders: list[EndpointState] = field(default_factory=list)
    """E/PD: the endpoints that encode the request's multimodal inputs, named to the
    decode sidecar in `x-encoder-hosts-ports`; empty when no encode stage ran."""
    rank_header: bool = False
    """vLLM's single-API-server data parallelism: each attempt names the target's
    least-loaded rank in `X-data-parallel-rank`."""
    upstream_headers: dict[str, str] = field(default_factory=dict)
    """Headers `PreRequest` plugins add to the request sent to the replica (llm-d's
    `x-kv-cache-source-host-port` from `p2p-source-producer`)."""

    @property
    def targets(self) -> list[EndpointState]:
        return [self.endpoint, *self.fallbacks]


@runtime_checkable
class ProfileHandler(Plugin, Protocol):
    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        """Profiles to run next given the results so far; empty when done."""
        ...

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        """Turn the profile results into a decision; None when nothing fits."""
        ...


@runtime_checkable
class PreRequest(Protocol):
    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None: ...


RECORDS_DECISIONS = "records_decisions"
"""An optional `PreRequest` attribute, read once when the scheduler is built (plugins
bound): `False` when its `pre_request` does nothing in this configuration (a filter that
reads another plugin's index, a precise scorer without speculative indexing), so the
scheduler need not call it on every request. Absent means `True`."""


@runtime_checkable
class ResponseComplete(Protocol):
    def response_complete(
        self, request: LLMRequest, endpoint: EndpointState, now: float
    ) -> None: ...


class NoCandidates(Exception):
    """No endpoint survived the filters."""
