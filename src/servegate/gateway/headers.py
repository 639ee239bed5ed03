"""Request headers of llm-d and the Endpoint Picker Protocol that steer routing in HTTP mode.

    x-gateway-destination-endpoint-subset  candidates are narrowed to these pool members
    x-llm-d-model-name-rewrite             the model the replica is asked for (no rule
    (x-gateway-model-name-rewrite)         for the requested model: llm-d lets rules win)

And the response headers that report the routing:

    x-gateway-destination-endpoint         the endpoint that answered
    x-gateway-destination-endpoint-served  the same, under the protocol's "served" name

Subset semantics are the Endpoint Picker Protocol's: with the key present the
picker chooses only among the listed endpoints; entries that are not pool
members are ignored; when none is left (or the list is empty) the answer is
503 `rejected-no-endpoints`. An entry `ip:port` names that endpoint, a bare
`ip` every endpoint on that host. (llm-d compares addresses only, ignoring the
port; servegate keeps the port, so that replicas sharing a host can be told
apart.) In HTTP mode the list is a comma-separated header value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from servegate.pool.endpoint import EndpointState

SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
MODEL_REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")


def subset_of(headers: Mapping[str, str]) -> tuple[str, ...] | None:
    """The subset a request names (lower-cased headers); None when it names none."""
    value = headers.get(SUBSET_HEADER)
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def within_subset(candidates: list[EndpointState], subset: Sequence[str]) -> list[EndpointState]:
    """Candidates the subset allows: `ip:port` entries match exactly, a bare `ip` every port."""
    allowed = set(subset)
    return [s for s in candidates if s.address in allowed or s.endpoint.host in allowed]


def model_rewrite_of(headers: Mapping[str, str]) -> str | None:
    """The model named by llm-d's model-name-rewrite header (current name first)."""
    for name in MODEL_REWRITE_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return value
    return None
