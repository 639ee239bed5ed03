"""The routing headers a decision asks the replica's side to honour (llm-d's sidecar protocol).

For a data plane that does not forward the request itself (Envoy, after the ext_proc
picker answered) these headers and destinations are the whole P/D and data-parallel
plan; the HTTP gateway's `Disaggregator` writes the same headers when it runs in sidecar
mode, and can instead run the prefill leg itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from servegate.scheduling.disagg import (
    DATA_PARALLEL_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    ENCODERS_HEADER,
    PREFILLER_HEADER,
    least_loaded_rank,
)

if TYPE_CHECKING:
    from servegate.pool.endpoint import EndpointState
    from servegate.scheduling.framework import Decision


def sidecar_headers(decision: Decision) -> dict[str, str]:
    """The headers llm-d's sidecar protocol adds for `decision` (for any data plane)."""
    out: dict[str, str] = {}
    if decision.prefill is not None:
        out[PREFILLER_HEADER] = decision.prefill.address
    if decision.encoders:
        out[ENCODERS_HEADER] = ",".join(s.address for s in decision.encoders)
    if decision.primary_port is not None:
        out[DATA_PARALLEL_HEADER] = decision.endpoint.address
    return out


def rank_header(state: EndpointState) -> dict[str, str]:
    """vLLM's single-API-server data parallelism: the endpoint's least-loaded rank, if any."""
    rank = least_loaded_rank(state)
    return {} if rank is None else {DATA_PARALLEL_RANK_HEADER: str(rank)}


def primary_address(state: EndpointState, primary_port: int) -> str:
    """Where a data-parallel rank behind a sidecar is reached: its host, the primary port."""
    host = state.endpoint.host
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{primary_port}"


def forwarded_elsewhere(
    decision: Decision, targets: Sequence[EndpointState]
) -> tuple[list[str], dict[str, str]]:
    """Destinations (primary first) and routing headers for a proxy that forwards by itself."""
    headers = {**decision.upstream_headers, **sidecar_headers(decision)}
    if decision.primary_port is not None:
        port = decision.primary_port
        destinations = list(dict.fromkeys(primary_address(s, port) for s in targets))
        return destinations, headers
    if decision.rank_header and targets:
        headers.update(rank_header(targets[0]))
    return [s.address for s in targets], headers
