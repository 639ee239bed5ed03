"""The Pool: the one owner of endpoints and their live state.

Discovery adds and removes endpoints, the scraper writes metrics, the health
checker writes health, the gateway counts in-flight work. Everyone else reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.pool.sanity import MAX_IN_FLIGHT, MAX_IN_FLIGHT_TOKENS, in_flight_count, sane


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A model id the pool can serve; `parent` is the base model of a LoRA adapter."""

    id: str
    parent: str | None = None
    base: str = field(init=False, repr=False, compare=False)
    """`parent or id`: the model whose endpoints serve this one (read per request, so
    set once here rather than computed by a property each time)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", self.parent or self.id)


Listener = Callable[[str, EndpointState], None]
StateWatcher = Callable[[EndpointState], None]
InFlightWatcher = Callable[[EndpointState], None]


CANDIDATE_LISTS = 256
"""Candidate lists a pool remembers (one per base model and adapter asked for)."""


class Pool:
    def __init__(self, name: str = "default", staleness: float = 2.0) -> None:
        self.name = name
        self.staleness = staleness
        self._states: dict[str, EndpointState] = {}
        self._declared_models: dict[str, ModelEntry] = {}
        self._discovered: dict[str, dict[str, ModelEntry]] = {}
        self._models: dict[str, ModelEntry] = {}
        self._listeners: list[Listener] = []
        self._watchers: list[StateWatcher] = []
        self._in_flight_watchers: list[InFlightWatcher] = []
        self._version = 0
        self._candidates: dict[
            tuple[str | None, str | None], tuple[int, float, list[EndpointState]]
        ] = {}

    # -- membership (discovery) -------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """`listener("added"|"removed", state)`: lets the data layer start/stop tasks."""
        self._listeners.append(listener)

    def watch_state(self, watcher: StateWatcher) -> None:
        """`watcher(state)` after every write of live state (metrics, health, drain, ejection).

        Lets waiters (flow control) react to a scrape instead of polling; called
        on the event loop's thread, so it must be cheap and must not block.
        """
        self._watchers.append(watcher)

    def watch_in_flight(self, watcher: InFlightWatcher) -> None:
        """`watcher(state)` after this process's in-flight counts change (scale-out sharing)."""
        self._in_flight_watchers.append(watcher)

    def _changed(self, state: EndpointState) -> None:
        for watcher in self._watchers:
            watcher(state)

    def add(self, endpoint: Endpoint) -> EndpointState:
        existing = self._states.get(endpoint.address)
        if existing is not None and existing.endpoint == endpoint:
            return existing
        if existing is not None:
            self.remove(endpoint.address)
        state = EndpointState(endpoint=endpoint)
        self._states[endpoint.address] = state
        self._version += 1
        if endpoint.model:
            self._declared_models.setdefault(endpoint.model, ModelEntry(endpoint.model))
        self._rebuild_models()
        for listener in self._listeners:
            listener("added", state)
        return state

    def remove(self, address: str) -> EndpointState | None:
        state = self._states.pop(address, None)
        if state is None:
            return None
        self._version += 1
        self._discovered.pop(address, None)
        self._rebuild_models()
        for listener in self._listeners:
            listener("removed", state)
        return state

    def declare_model(self, model_id: str, parent: str | None = None) -> None:
        self._declared_models[model_id] = ModelEntry(model_id, parent)
        self._rebuild_models()

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._states.values()))

    def get(self, address: str) -> EndpointState | None:
        return self._states.get(address)

    # -- live state (data layer) ------------------------------------------------
    def set_metrics(self, address: str, metrics: EndpointMetrics) -> None:
        """Clamped into range first (`servegate.pool.sanity.sane`): whoever reported them."""
        state = self._states.get(address)
        if state is not None:
            state.metrics = sane(metrics)
            self._changed(state)

    def set_health(self, address: str, healthy: bool) -> None:
        state = self._states.get(address)
        if state is not None:
            if state.healthy != healthy:
                state.healthy = healthy
                self._version += 1
            self._changed(state)

    def set_served_models(self, address: str, models: Iterable[ModelEntry]) -> None:
        state = self._states.get(address)
        if state is None:
            return
        entries = {m.id: m for m in models}
        served = frozenset(entries)
        if served != state.served_models:
            state.served_models = served
            self._version += 1
        self._discovered[address] = entries
        self._rebuild_models()

    def set_draining(self, address: str, draining: bool) -> bool:
        state = self._states.get(address)
        if state is None:
            return False
        if state.draining != draining:
            state.draining = draining
            self._version += 1
        self._changed(state)
        return True

    def eject(self, address: str, until: float) -> None:
        state = self._states.get(address)
        if state is not None:
            state.ejected_until = until
            self._version += 1
            self._changed(state)

    # -- in-flight accounting (gateway) -----------------------------------------
    def acquire(self, state: EndpointState, tokens: int, now: float | None = None) -> None:
        state.in_flight_requests += 1
        state.in_flight_tokens += tokens
        state.local_in_flight_requests += 1
        state.local_in_flight_tokens += tokens
        state.picks += 1
        state.last_picked_at = time.monotonic() if now is None else now
        for watcher in self._in_flight_watchers:
            watcher(state)

    def release(self, state: EndpointState, tokens: int) -> None:
        state.in_flight_requests = max(0, state.in_flight_requests - 1)
        state.in_flight_tokens = max(0, state.in_flight_tokens - tokens)
        state.local_in_flight_requests = max(0, state.local_in_flight_requests - 1)
        state.local_in_flight_tokens = max(0, state.local_in_flight_tokens - tokens)
        for watcher in self._in_flight_watchers:
            watcher(state)

    def set_peer_in_flight(self, address: str, requests: int, tokens: int) -> None:
        """Scale-out peers' in-flight work on `address`; the totals scorers read include it.

        Capped at `sanity.MAX_IN_FLIGHT` requests and `MAX_IN_FLIGHT_TOKENS` tokens: what
        peers say is input from other processes."""
        state = self._states.get(address)
        if state is None:
            return
        requests = in_flight_count(requests, MAX_IN_FLIGHT)
        tokens = in_flight_count(tokens, MAX_IN_FLIGHT_TOKENS)
        state.peer_in_flight_requests = requests
        state.peer_in_flight_tokens = tokens
        state.in_flight_requests = state.local_in_flight_requests + requests
        state.in_flight_tokens = state.local_in_flight_tokens + tokens

    def served_entries(self, address: str) -> tuple[ModelEntry, ...]:
        """The model entries (with LoRA parents) the endpoint's /v1/models listed."""
        return tuple(self._discovered.get(address, {}).values())

    # -- reads (scheduler, gateway) ---------------------------------------------
    @property
    def models(self) -> dict[str, ModelEntry]:
        return self._models

    def resolve_model(self, model: str) -> ModelEntry | None:
        return self._models.get(model)

    def is_available(self, state: EndpointState, now: float) -> bool:
        return state.healthy and not state.draining and state.ejected_until <= now

    def candidates(
        self, base_model: str | None, now: float, adapter: str | None = None
    ) -> list[EndpointState]:
        """Ready endpoints that serve `base_model` (None: every ready endpoint).

        For a LoRA `adapter`, endpoints that list it in their /v1/models come first: if
        any do, only they are candidates (a replica without the adapter would answer
        404); if none do, every base-model endpoint is (adapters loaded on demand).

        The list is shared until membership, health, drain, ejection or served models
        change (or an ejection runs out), so a steady pool costs no pass per request:
        callers must not modify it.
        """
        key = (base_model, adapter)
        hit = self._candidates.get(key)
        if hit is not None and hit[0] == self._version and now < hit[1]:
            return hit[2]
        out = []
        expires = float("inf")
        for state in self._states.values():
            if state.ejected_until > now:
                expires = min(expires, state.ejected_until)
                continue
            if not state.healthy or state.draining:
                continue
            if base_model is not None and not self._serves(state, base_model):
                continue
            out.append(state)
        if adapter is not None:
            holding = [s for s in out if adapter in s.served_models]
            if holding:
                out = holding
        if len(self._candidates) >= CANDIDATE_LISTS:
            self._candidates.clear()  # adapter names come from clients: stay bounded
        self._candidates[key] = (self._version, expires, out)
        return out

    def ready_count(self, now: float | None = None) -> int:
        t = time.monotonic() if now is None else now
        return sum(1 for s in self._states.values() if self.is_available(s, t))

    @staticmethod
    def _serves(state: EndpointState, base_model: str) -> bool:
        if state.endpoint.model is not None:
            return state.endpoint.model == base_model
        return base_model in state.served_models

    def _rebuild_models(self) -> None:
        models = dict(self._declared_models)
        for entries in self._discovered.values():
            for entry in entries.values():
                models.setdefault(entry.id, entry)
        self._models = models
