"""A request's in-flight hold on its pool runtime, its flow-control slot and its endpoint.

One object owns every count a request raises while it is in flight, so they are dropped
together and exactly once, however the request ends:

- the runtime's (a retired runtime stops when its last lease is released);
- flow control's (`GatewayAdmission.completed`), once the request was admitted;
- the endpoint's in-flight requests and tokens (what load scorers read), bound
  synchronously right after `schedule()` so that nothing awaits between a pick and its
  count, and moved when a fallback endpoint serves instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servegate.gateway.pools import PoolRuntime
    from servegate.pool.endpoint import EndpointState
    from servegate.pool.pool import Pool


class Lease:
    __slots__ = ("_admitted", "_released", "pool", "runtime", "state", "tokens")

    def __init__(self, runtime: PoolRuntime) -> None:
        self.runtime = runtime
        self.pool: Pool = runtime.state.pool
        """The runtime's pool (fixed for its life), where the endpoint count is held."""
        self.state: EndpointState | None = None
        """The endpoint holding the request's in-flight count; None before scheduling."""
        self.tokens = 0
        self._admitted = False
        self._released = False
        runtime.enter()

    def admit(self) -> None:
        """Flow control let the request through: its slot is released with the lease."""
        self._admitted = True

    @property
    def admitted(self) -> bool:
        return self._admitted

    def bind(self, state: EndpointState, tokens: int, now: float) -> None:
        """Count the request on the endpoint the scheduler picked."""
        self.tokens = tokens
        self.state = state
        self.pool.acquire(state, tokens, now)

    def move(self, state: EndpointState) -> None:
        """Another endpoint serves the request (a fallback): the count moves there."""
        held = self.state
        if held is state or self._released:
            return
        pool = self.pool
        if held is not None:
            pool.release(held, self.tokens)
        pool.acquire(state, self.tokens)
        self.state = state

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        runtime = self.runtime
        if self.state is not None:
            self.pool.release(self.state, self.tokens)
        if self._admitted:
            runtime.admission.completed()
        runtime.leave()
