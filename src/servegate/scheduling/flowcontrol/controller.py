"""The flow controller: holds requests back while the pool is saturated, then releases them in order.

`admit()` either returns at once (the pool has room and nobody is waiting), or
queues the request and waits until the dispatcher releases it, its TTL runs out,
the queue refuses it, or the caller is cancelled (the client left). Dispatch is
event-driven: `notify()` is called when a request completes, when a scrape or a
health probe writes new state, and when an operator changes an endpoint; each
call releases queued requests while the detector says the pool has room. One
timer guards against a silent pool: while requests wait it re-checks once per
detector staleness horizon, when stale metrics can change the verdict. Nothing
here polls.

Requests released but not yet routed count as `pending` in the saturation
check, so one wake-up cannot release a whole queue onto metrics that do not yet
show the first releases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from time import perf_counter

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.flowcontrol.queues import DEFAULT_FLOW, FlowQueues, QueueFull, Ticket
from servegate.scheduling.flowcontrol.saturation import SATURATED, SaturationDetector

RECHECK_S = 1.0
"""The watchdog's period while requests wait, when the detector has no staleness horizon."""


class Outcome(StrEnum):
    """How a request left flow control; values are llm-d's queue outcome names."""

    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_SATURATED = "RejectedSaturated"
    REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
    EVICTED_CONTEXT_CANCELLED = "EvictedContextCancelled"
    EVICTED_SHUTDOWN = "EvictedShutdown"


DROPPED_REASONS: dict[Outcome, str] = {
    Outcome.REJECTED_CAPACITY: "rejected-saturated",
    Outcome.REJECTED_SATURATED: "rejected-saturated",
    Outcome.REJECTED_NO_ENDPOINTS: "rejected-no-endpoints",
    Outcome.EVICTED_TTL: "rejected-ttl-expired",
    Outcome.EVICTED_NO_ENDPOINTS: "rejected-no-endpoints",
    Outcome.EVICTED_CONTEXT_CANCELLED: "rejected-context-cancelled",
    Outcome.EVICTED_SHUTDOWN: "rejected-shutting-down",
}
"""The `x-llm-d-request-dropped-reason` of every outcome but `Dispatched`."""


class Rejected(Exception):
    """The request leaves flow control without being dispatched."""

    def __init__(
        self, outcome: Outcome, message: str, waited_s: float = 0.0, queued: bool = False
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.reason = DROPPED_REASONS[outcome]
        self.message = message
        self.waited_s = waited_s
        self.queued = queued
        """True when the request had been queued (and left the queue this way)."""


@dataclass(frozen=True, slots=True)
class Admission:
    waited_s: float
    """Seconds spent queued (0.0 when dispatched at once)."""
    queued: bool


@dataclass(slots=True)
class FlowStats:
    """Counters the controller keeps; exporters read them."""

    outcomes: dict[tuple[int, Outcome], int] = field(default_factory=dict)
    """Requests by (priority, outcome)."""
    wakeups: int = 0
    """Calls to `notify` that ran the dispatcher."""
    last_saturation: float = 0.0
    """Pool saturation at the last check."""

    def count(self, priority: int, outcome: Outcome) -> None:
        key = (priority, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


EnqueueObserver = Callable[[int, str, str, float], None]
"""(priority, flow, outcome, seconds): one request's way into flow control, timed."""
DispatchObserver = Callable[[float], None]
"""Seconds one dispatch cycle took (a pass over the queues that released what fit)."""
NOT_YET_FINALIZED = "NotYetFinalized"
"""The enqueue outcome of a request that was queued (llm-d's name)."""
DISPATCHED = Outcome.DISPATCHED.value
AT_ONCE = Admission(0.0, False)
"""The admission of every request dispatched without waiting."""


class FlowController:
    def __init__(
        self,
        detector: SaturationDetector,
        endpoints: Callable[[float], Sequence[EndpointState]],
        queues: FlowQueues | None = None,
        *,
        enabled: bool = True,
        ttl_s: float = 60.0,
        band_ttl_s: Mapping[int, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`endpoints(now)` = the endpoints that take requests now; `ttl_s` 0 = wait forever;
        `band_ttl_s` (priority → seconds) overrides `ttl_s` for the bands it names.

        With `enabled=False` nothing is queued: requests pass, except that
        negative priorities are shed while the pool is saturated (llm-d's
        behaviour with the flowControl feature gate off).
        """
        self.detector = detector
        self.endpoints = endpoints
        self.queues = queues if queues is not None else FlowQueues()
        self.enabled = enabled
        self.ttl_s = ttl_s
        self.band_ttl_s = dict(band_ttl_s or {})
        self.stats = FlowStats()
        self.pending = 0
        """Requests released by the dispatcher whose callers have not resumed yet."""
        self.pending_tokens = 0
        self._clock = clock
        self._closed = False
        self._watchdog: asyncio.TimerHandle | None = None
        self.on_enqueue: EnqueueObserver | None = None
        self.on_dispatch: DispatchObserver | None = None
        staleness = getattr(detector, "staleness", None)
        self._recheck_s = float(staleness) if isinstance(staleness, int | float) else RECHECK_S

    # -- the gate --------------------------------------------------------------------
    def saturation(self, now: float | None = None) -> float:
        t = self._clock() if now is None else now
        return self._saturation(self.endpoints(t), t)

    def _saturation(self, endpoints: Sequence[EndpointState], now: float) -> float:
        value = self.detector.saturation(endpoints, now, self.pending, self.pending_tokens)
        self.stats.last_saturation = value
        return value

    def _has_endpoints(self, now: float) -> bool:
        return bool(self.endpoints(now))

    # -- requests --------------------------------------------------------------------
    async def admit(
        self, priority: int = 0, flow: str = "", size: int = 0, tokens: int = 0
    ) -> Admission:
        """Wait for a dispatch slot; raises `Rejected` (and re-raises cancellation)."""
        if self.admit_now(priority, flow):
            return AT_ONCE
        return await self.wait(priority, flow, size, tokens)

    def admit_now(self, priority: int = 0, flow: str = "") -> bool:
        """`admit` without a coroutine for a request that need not wait: True when it is
        dispatched at once (counted and observed as `admit` does), False when it must be
        queued (then `await wait(...)`, with nothing awaited in between); raises
        `Rejected` when it is turned away at the gate."""
        started = perf_counter()
        try:
            dispatched = self.gate(priority)
        except Rejected as exc:
            self._enqueued(priority, flow, exc.outcome.value, started)
            raise
        if dispatched:
            self._enqueued(priority, flow, DISPATCHED, started)
        return dispatched

    def _enqueued(self, priority: int, flow: str, outcome: str, started: float) -> None:
        observe = self.on_enqueue
        if observe is not None:
            observe(priority, flow or DEFAULT_FLOW, outcome, perf_counter() - started)

    def gate(self, priority: int) -> bool:
        """`admit_now` without the enqueue observation (for a caller that times and
        observes it itself): True: dispatched now; False: the request must wait in the
        queues. Reads the available endpoints once, for the endpoint check and the
        detector alike."""
        if self._closed:
            self.stats.count(priority, Outcome.EVICTED_SHUTDOWN)
            raise Rejected(Outcome.EVICTED_SHUTDOWN, "the gateway is shutting down")
        now = self._clock()
        endpoints = self.endpoints(now)
        if not endpoints:
            self.stats.count(priority, Outcome.REJECTED_NO_ENDPOINTS)
            raise Rejected(Outcome.REJECTED_NO_ENDPOINTS, "no endpoint takes requests")
        if self.enabled:
            if not self.queues.requests and self._saturation(endpoints, now) < SATURATED:
                self.stats.count(priority, Outcome.DISPATCHED)
                return True
            if priority >= 0 or self._saturation(endpoints, now) < SATURATED:
                return False
        elif priority >= 0 or self._saturation(endpoints, now) < SATURATED:
            self.stats.count(priority, Outcome.DISPATCHED)
            return True
        self.stats.count(priority, Outcome.REJECTED_SATURATED)
        raise Rejected(
            Outcome.REJECTED_SATURATED,
            f"the pool is saturated; priority {priority} requests are shed",
        )

    async def wait(self, priority: int, flow: str, size: int = 0, tokens: int = 0) -> Admission:
        """Queue a request `admit_now` did not dispatch, and wait for its turn."""
        started = perf_counter()
        try:
            return await self._wait(
                priority, flow or DEFAULT_FLOW, size, tokens, self._clock(), started
            )
        except Rejected as exc:
            if not exc.queued:
                self._enqueued(priority, flow, exc.outcome.value, started)
            raise

    async def _wait(
        self, priority: int, flow: str, size: int, tokens: int, now: float, started: float
    ) -> Admission:
        loop = asyncio.get_running_loop()
        ticket = Ticket(flow=flow, priority=priority, size=size, tokens=tokens, enqueued_at=now)
        try:
            self.queues.push(ticket)
        except QueueFull as exc:
            self.stats.count(priority, Outcome.REJECTED_CAPACITY)
            raise Rejected(Outcome.REJECTED_CAPACITY, f"{exc}; try again later") from exc
        waiter: asyncio.Future[Outcome] = loop.create_future()
        ticket.waiter = waiter
        ttl = self.band_ttl_s.get(priority, self.ttl_s)
        expiry = loop.call_later(ttl, self._expire, ticket) if ttl > 0 else None
        self._dispatch()
        self._enqueued(priority, flow, NOT_YET_FINALIZED, started)
        try:
            outcome = await waiter
        except asyncio.CancelledError:
            if self.queues.remove(ticket):
                self.stats.count(priority, Outcome.EVICTED_CONTEXT_CANCELLED)
            elif waiter.done() and not waiter.cancelled() and waiter.result() is Outcome.DISPATCHED:
                self._resumed(ticket)
                self._dispatch()
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
        waited = self._clock() - ticket.enqueued_at
        if outcome is Outcome.DISPATCHED:
            self._resumed(ticket)
            return Admission(waited, True)
        message = {
            Outcome.EVICTED_TTL: f"waited {waited:.1f} s for capacity (the TTL); try again later",
            Outcome.EVICTED_NO_ENDPOINTS: "no endpoint takes requests",
            Outcome.EVICTED_SHUTDOWN: "the gateway is shutting down",
        }.get(outcome, outcome.value)
        raise Rejected(outcome, message, waited, queued=True)

    def _resumed(self, ticket: Ticket) -> None:
        self.pending = max(0, self.pending - 1)
        self.pending_tokens = max(0, self.pending_tokens - ticket.tokens)

    def _expire(self, ticket: Ticket) -> None:
        if not self.queues.remove(ticket):
            return
        outcome = (
            Outcome.EVICTED_TTL
            if self._has_endpoints(self._clock())
            else Outcome.EVICTED_NO_ENDPOINTS
        )
        self._finish(ticket, outcome)

    def _finish(self, ticket: Ticket, outcome: Outcome) -> None:
        self.stats.count(ticket.priority, outcome)
        waiter = ticket.waiter
        if isinstance(waiter, asyncio.Future) and not waiter.done():
            waiter.set_result(outcome)

    # -- dispatch --------------------------------------------------------------------
    def notify(self) -> None:
        """Something changed (a completion, a scrape, an operator): release what fits."""
        if self.queues.requests:
            self.stats.wakeups += 1
            self._dispatch()

    def _dispatch(self) -> None:
        observe = self.on_dispatch
        if observe is None:
            self._dispatch_cycle()
            return
        started = perf_counter()
        self._dispatch_cycle()
        observe(perf_counter() - started)

    def _dispatch_cycle(self) -> None:
        queues = self.queues
        while queues.requests:
            now = self._clock()
            if self.saturation(now) >= SATURATED:
                self._arm_watchdog()
                return
            ticket = queues.pop()
            if ticket is None:
                break
            self.pending += 1
            self.pending_tokens += ticket.tokens
            self._finish(ticket, Outcome.DISPATCHED)

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._watchdog = loop.call_later(self._recheck_s, self._watchdog_fired)

    def _watchdog_fired(self) -> None:
        self._watchdog = None
        self.notify()

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> int:
        """Refuse new requests and turn every queued one away; returns how many were queued."""
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        tickets = self.queues.drain()
        for ticket in tickets:
            self._finish(ticket, Outcome.EVICTED_SHUTDOWN)
        return len(tickets)

    def queued_by_priority(self) -> dict[int, int]:
        return {band.priority: band.requests for band in self.queues.bands()}
