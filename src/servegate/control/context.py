"""One request on its way through the `Director`, whichever data plane carried it in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from servegate.gateway.access_log import AccessRecord

if TYPE_CHECKING:
    from servegate.control.lease import Lease
    from servegate.control.snapshot import RoutingSnapshot
    from servegate.gateway.latency import Ticket
    from servegate.gateway.metrics import RequestSeries
    from servegate.gateway.pools import PoolRuntime
    from servegate.gateway.tenants import Tenant
    from servegate.scheduling.framework import Decision
    from servegate.scheduling.request import LLMRequest

NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(slots=True, eq=False)
class RequestContext:
    """What the Director learned about one request, and what the adapter must send.

    The adapter fills the wire facts (`request_id`, `record`'s method and path, the
    lower-cased `headers`); the Director fills the rest step by step, so that a failure
    at any step leaves exactly what `Director.finish` must account for.
    """

    snapshot: RoutingSnapshot
    """Read once when the request began; kept across every await."""
    request_id: str
    record: AccessRecord
    started: float
    """`time.monotonic()` at arrival."""
    headers: Mapping[str, str]
    """The client's request headers, names lower-cased."""
    upstream_headers: Mapping[str, str]
    """Routing headers for the replica that the decision asks for (a P2P KV source…);
    `NO_HEADERS` until the request is scheduled."""
    tenant: Tenant | None = None
    llm: LLMRequest | None = None
    runtime: PoolRuntime | None = None
    lease: Lease | None = None
    series: RequestSeries | None = None
    decision: Decision | None = None
    ticket: Ticket | None = None
    """The latency predictor's note on the dispatch, learned from when the request ends."""
    body: bytes = b""
    """The body for the replica: the client's, with the served model written in."""
    estimated: int = 0
    """Tokens charged to the tenant up front (prompt + max_tokens)."""
    request_bytes: int = 0
    queued_s: float = 0.0
    error_code: str | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    """Headers the client's response carries (request id, flow-control wait, session token,
    served model, debug scores)."""

    @property
    def tokens(self) -> int:
        """The in-flight token count the request holds on its endpoint."""
        llm = self.llm
        return 0 if llm is None else llm.prompt_tokens + (llm.max_tokens or 0)
