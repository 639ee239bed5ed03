"""What the ext_proc data plane adds to the `Director`'s decision: where Envoy sends it.

The routing itself is the HTTP gateway's, step for step (`control/director.py`: every
pool, model rewrites, flow control, the proxy's subset hint, SLO admission, the
scheduler, the in-flight lease). Envoy forwards the request, so the P/D and
data-parallel plan is expressed as llm-d's sidecar headers and destinations
(`control/upstream.py`); the gateway-run prefill leg exists only in HTTP mode.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from servegate.control.errors import NoEndpoints
from servegate.control.snapshot import RoutingSnapshot
from servegate.control.upstream import forwarded_elsewhere
from servegate.gateway.headers import within_subset
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.framework import Decision


@dataclass(frozen=True, slots=True)
class Routed:
    decision: Decision
    targets: tuple[EndpointState, ...]
    """Primary first, then fallbacks: at most `gateway.max_retries + 1`, as in HTTP mode."""
    destinations: str
    """The `x-gateway-destination-endpoint` value: `ip:port[,ip:port…]`."""
    headers: dict[str, str]
    """Routing headers for the replica's side (lower-case names): the prefill endpoint,
    encoders, data-parallel rank, P2P KV-cache source."""


def envoy_route(snapshot: RoutingSnapshot, decision: Decision) -> Routed:
    """Where Envoy sends a scheduled request, and the routing headers it adds."""
    targets = tuple(decision.targets[: snapshot.config.gateway.max_retries + 1])
    destinations, headers = forwarded_elsewhere(decision, targets)
    lowered = {name.lower(): value for name, value in headers.items()}
    return Routed(decision, targets, ",".join(destinations), lowered)


def pick_any(
    snapshot: RoutingSnapshot, rng: random.Random, subset: Sequence[str] | None, now: float
) -> EndpointState:
    """A request without a body (`GET /v1/models`): any available endpoint of the default
    pool, by the gateway's random generator."""
    candidates = snapshot.default.pool.candidates(None, now)
    if subset is not None:
        candidates = within_subset(candidates, subset)
    if not candidates:
        raise NoEndpoints("no ready endpoint in the pool")
    return candidates[rng.randrange(len(candidates))]
