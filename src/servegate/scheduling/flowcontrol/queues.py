"""Priority bands of flows of requests: the data structure flow control dispatches from.

Three tiers, as in llm-d: a strict priority order between bands (the highest
non-empty band always goes first), round-robin between the flows of a band
(one request per flow per turn, so one busy tenant cannot starve another), and
first-come-first-served inside a flow. Every band has limits in requests and
bytes, and so may the whole queue; a request that would exceed one is refused
at the door. Removal of any queued request (expiry, a client that left) is
O(1) and frees its capacity at once. Nothing here awaits or reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DEFAULT_FLOW = "default-flow"


@dataclass(frozen=True, slots=True)
class BandLimits:
    max_requests: int = 5000
    """Requests queued in the band; llm-d's default."""
    max_bytes: int = 1_000_000_000
    """Bytes of request bodies queued in the band; llm-d's default (1 GB)."""


@dataclass(eq=False, slots=True)
class Ticket:
    """One queued request; `waiter` belongs to whoever waits on it (the controller)."""

    flow: str
    priority: int
    size: int
    tokens: int = 0
    enqueued_at: float = 0.0
    queued: bool = False
    waiter: Any = None


@dataclass(slots=True)
class Band:
    priority: int
    limits: BandLimits
    requests: int = 0
    bytes: int = 0
    flows: OrderedDict[str, OrderedDict[Ticket, None]] = field(default_factory=OrderedDict)
    """Flows in round-robin order; each flow's tickets in arrival order."""

    def fits(self, size: int) -> bool:
        return self.requests + 1 <= self.limits.max_requests and self.bytes + size <= (
            self.limits.max_bytes
        )


class QueueFull(Exception):
    """The band or the whole queue has no room for this request."""


class FlowQueues:
    def __init__(
        self,
        bands: dict[int, BandLimits] | None = None,
        default_band: BandLimits | None = None,
        default_negative_band: BandLimits | None = None,
        max_requests: int = 0,
        max_bytes: int = 0,
    ) -> None:
        """`max_requests`/`max_bytes` bound the whole queue; 0 = no global bound."""
        self.default_band = default_band or BandLimits()
        self.default_negative_band = default_negative_band or self.default_band
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0
        self._bands: dict[int, Band] = {}
        self._order: list[Band] = []
        for priority, limits in (bands or {}).items():
            self._add_band(priority, limits)
        self.band(0)

    def _add_band(self, priority: int, limits: BandLimits) -> Band:
        band = Band(priority, limits)
        self._bands[priority] = band
        self._order = sorted(self._bands.values(), key=lambda b: -b.priority)
        return band

    def band(self, priority: int) -> Band:
        """The band of `priority`, made from the default template the first time it is seen."""
        band = self._bands.get(priority)
        if band is None:
            template = self.default_negative_band if priority < 0 else self.default_band
            band = self._add_band(priority, template)
        return band

    def bands(self) -> Iterator[Band]:
        """Highest priority first."""
        return iter(self._order)

    def __len__(self) -> int:
        return self.requests

    def push(self, ticket: Ticket) -> None:
        """Queue `ticket` at the back of its flow, or raise `QueueFull`."""
        band = self.band(ticket.priority)
        if not band.fits(ticket.size):
            raise QueueFull(
                f"priority band {band.priority} is full "
                f"({band.requests} requests, {band.bytes} bytes queued)"
            )
        if (self.max_requests and self.requests + 1 > self.max_requests) or (
            self.max_bytes and self.bytes + ticket.size > self.max_bytes
        ):
            raise QueueFull(f"the flow-control queue is full ({self.requests} requests queued)")
        flow = band.flows.get(ticket.flow)
        if flow is None:
            flow = band.flows[ticket.flow] = OrderedDict()
        flow[ticket] = None
        ticket.queued = True
        band.requests += 1
        band.bytes += ticket.size
        self.requests += 1
        self.bytes += ticket.size

    def pop(self) -> Ticket | None:
        """The next ticket: highest band, next flow in turn, oldest in that flow."""
        for band in self._order:
            if band.requests:
                flow_id, flow = next(iter(band.flows.items()))
                ticket, _ = flow.popitem(last=False)
                if flow:
                    band.flows.move_to_end(flow_id)
                else:
                    del band.flows[flow_id]
                self._account(band, ticket)
                return ticket
        return None

    def peek_priority(self) -> int | None:
        """The priority of the band `pop` would serve, or None when empty."""
        for band in self._order:
            if band.requests:
                return band.priority
        return None

    def remove(self, ticket: Ticket) -> bool:
        """Take `ticket` out wherever it waits; False when it is no longer queued."""
        if not ticket.queued:
            return False
        band = self._bands[ticket.priority]
        flow = band.flows[ticket.flow]
        del flow[ticket]
        if not flow:
            del band.flows[ticket.flow]
        self._account(band, ticket)
        return True

    def drain(self) -> list[Ticket]:
        """Every queued ticket, removed, highest priority first."""
        out = []
        while (ticket := self.pop()) is not None:
            out.append(ticket)
        return out

    def _account(self, band: Band, ticket: Ticket) -> None:
        ticket.queued = False
        band.requests -= 1
        band.bytes -= ticket.size
        self.requests -= 1
        self.bytes -= ticket.size
