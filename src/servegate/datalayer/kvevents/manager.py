"""One KV-event subscriber per replica, following the pool's membership.

Where a replica publishes: its own `kv_events` endpoint when configured, else
`tcp://<replica host>:<port>` when the pool sets a KV-event port. Its replay
socket likewise (`kv_events_replay`, or the pool's replay port). With a bind
endpoint (`tcp://*:5557`, llm-d's global socket mode) one SUB socket receives
every replica's batches and the topic's `@<host:port>@` part says whose they are.

Nothing configured (`auto`): llm-d's convention, `tcp://<replica host>:5557`, for
every replica that is the only pool member on its host (several replicas on one
host cannot all publish on one port, so they need their own `kv_events`). A
missing publisher costs one idle SUB socket that ZeroMQ keeps reconnecting; a
batch whose topic names another replica (`kv@<host:port>@…`) is dropped. The replay
socket is llm-d's `tcp://<replica host>:5558`; when it does not answer the first
replay (on the first batch, or a gap) it is not asked again for that replica.

Batches go to every `BlockIndex` (one per precise prefix scorer). A replica
removed from the pool loses its subscriber and its blocks.

Who may speak for a replica (docs/reliability.md, threat model):

- per-replica (connect) mode: the subscriber connects to the replica's own
  address, so whatever arrives comes from that replica; the topic is not
  consulted. This is the trusted default for plain vLLM publishers.
- shared bind mode: the topic names the replica, so the origin must be proven.
  With `curve` the socket is a CURVE server that admits only authorized publisher
  keys (relays, bridges) and the topic must name a pool member. Without it, bind
  mode runs only with `allow_unauthenticated_bind`, logs a warning, and accepts a
  message only when its TCP source address is the host of the pool member the
  topic names (so a foreign host cannot steer prompts or send `AllBlocksCleared`
  for a replica; a process on the replica's own host still can).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import zmq.asyncio

from servegate.curve import CurveKeys
from servegate.datalayer.kvevents.settings import KVEventsSettings
from servegate.datalayer.kvevents.transport import (
    KVEventSubscriber,
    SubscriberStats,
    binds,
)
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.prefix.events import EventBatch

log = logging.getLogger(__name__)


class BlockIndex(Protocol):
    def apply(self, address: str, batch: EventBatch) -> None: ...

    def clear(self, address: str) -> None: ...


def _host(endpoint: str) -> str | None:
    parts = urlsplit(endpoint)
    return parts.hostname


def _bare(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def address_of_topic(topic: bytes) -> str | None:
    """`kv@<host:port>@<model>` → `host:port`."""
    parts = topic.decode("utf-8", "replace").split("@")
    return parts[1] if len(parts) >= 3 and parts[1] else None


class _EndpointSink:
    __slots__ = ("address", "check_topic", "indexes", "stats")

    def __init__(
        self,
        address: str,
        indexes: Sequence[BlockIndex],
        check_topic: bool = False,
        stats: SubscriberStats | None = None,
    ) -> None:
        self.address = address
        self.indexes = indexes
        self.check_topic = check_topic
        self.stats = stats

    def _foreign(self, topic: bytes) -> bool:
        if not self.check_topic:
            return False
        named = address_of_topic(topic)
        if named is None or named == self.address:
            return False
        if self.stats is not None:
            self.stats.drop("foreign-topic")
        return True

    def apply(self, topic: bytes, batch: EventBatch) -> None:
        if self._foreign(topic):
            return
        for index in self.indexes:
            index.apply(self.address, batch)

    def reset(self, topic: bytes) -> None:
        if self._foreign(topic):
            return
        for index in self.indexes:
            index.clear(self.address)


class _TopicSink:
    """Global socket mode: the topic names the replica."""

    def __init__(self, pool: Pool, indexes: Sequence[BlockIndex], stats: SubscriberStats) -> None:
        self.pool = pool
        self.indexes = indexes
        self.stats = stats

    def _address(self, topic: bytes) -> str | None:
        address = address_of_topic(topic)
        if address is None or self.pool.get(address) is None:
            self.stats.drop("unknown-topic")
            return None
        return address

    def apply(self, topic: bytes, batch: EventBatch) -> None:
        address = self._address(topic)
        if address is not None:
            for index in self.indexes:
                index.apply(address, batch)

    def reset(self, topic: bytes) -> None:
        address = self._address(topic)
        if address is not None:
            for index in self.indexes:
                index.clear(address)


class _Origins:
    """`admit` checks for bound sockets: who may speak for which pool member."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def _member(self, topic: bytes) -> EndpointState | None:
        address = address_of_topic(topic)
        return None if address is None else self.pool.get(address)

    def authenticated(self, topic: bytes, peer: str | None, user: str | None) -> str | None:
        """CURVE bind: ZAP admitted the key; the topic must still name a pool member."""
        if user is None:
            return "unauthenticated"
        return None if self._member(topic) is not None else "unknown-topic"

    def by_address(self, topic: bytes, peer: str | None, user: str | None) -> str | None:
        """Plain bind: the TCP source must be the host of the pool member the topic names."""
        state = self._member(topic)
        if state is None:
            return "unknown-topic"
        return None if peer is not None and _bare(state.endpoint.host) == peer else "wrong-origin"

    def for_replica(
        self, endpoint: Endpoint
    ) -> Callable[[bytes, str | None, str | None], str | None]:
        """A per-replica socket that binds (its `kv_events` says `*`): only that replica's host."""
        host = _bare(endpoint.host)

        def admit(topic: bytes, peer: str | None, user: str | None) -> str | None:
            return None if user is not None or peer == host else "wrong-origin"

        return admit


class KVEventsManager:
    def __init__(
        self,
        pool: Pool,
        indexes: Sequence[BlockIndex],
        settings: KVEventsSettings | None = None,
        *,
        auto: bool = False,
        replay_optional: bool = False,
    ) -> None:
        self.pool = pool
        self.indexes = list(indexes)
        self.settings = settings or KVEventsSettings()
        self.auto = auto
        """Nothing configured: `settings.port` is llm-d's convention, used for replicas alone
        on their host, and a topic that names another replica is dropped."""
        self.replay_optional = replay_optional
        """The replay port is a guess (llm-d's 5558, nothing configured): a replica whose
        replay socket does not answer once is not asked again."""
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._context: zmq.asyncio.Context | None = None
        self._running = False
        self._subscribed = False
        self._origins = _Origins(pool)
        self.keys: CurveKeys | None = (
            CurveKeys.load(self.settings.curve) if self.settings.curve is not None else None
        )
        """Loaded when the manager is built, so a bad key file fails at start-up."""
        curve = self.settings.curve
        self._curve_connects = curve is not None and curve.server_key_file is not None
        """Per-replica connections use CURVE only when the publishers' key is named."""

    def resolve(self, endpoint: Endpoint) -> tuple[str, str | None] | None:
        """(publisher endpoint, replay endpoint) of a replica, or None when unknown."""
        s = self.settings
        if endpoint.kv_events:
            url = endpoint.kv_events
            replay = endpoint.kv_events_replay
            if replay is None and s.replay_port is not None and url.startswith("tcp://"):
                host = _host(url)
                if host:
                    replay = f"tcp://{host}:{s.replay_port}"
            return url, replay
        if s.port is None or s.bind is not None:
            return None
        host = endpoint.host
        if self.auto and self._shares_host(endpoint):
            return None
        replay = endpoint.kv_events_replay
        if replay is None and s.replay_port is not None:
            replay = f"tcp://{host}:{s.replay_port}"
        return f"tcp://{host}:{s.port}", replay

    def _shares_host(self, endpoint: Endpoint) -> bool:
        return any(
            st.endpoint.host == endpoint.host and st.address != endpoint.address for st in self.pool
        )

    def status(self) -> dict[str, dict[str, object]]:
        """Per replica: where its KV events come from and whether any arrived."""
        out: dict[str, dict[str, object]] = {}
        bind = self.settings.bind
        for state in self.pool:
            resolved = self.resolve(state.endpoint)
            sub = self.subscribers.get(state.address)
            if resolved is None and bind is None:
                why = "shares its host; set its kv_events" if self.auto else "none"
                out[state.address] = {"kv_events": why, "receiving": False}
                continue
            url = resolved[0] if resolved is not None else bind
            stats = sub.stats if sub is not None else None
            if stats is None and bind is not None:
                bound = self.subscribers.get(bind)
                stats = bound.stats if bound is not None else None
            out[state.address] = {
                "kv_events": url,
                "auto": self.auto and state.endpoint.kv_events is None,
                "replay": (
                    sub.replay_endpoint
                    if sub is not None
                    else (resolved[1] if resolved is not None else None)
                ),
                "receiving": bool(stats is not None and stats.batches > 0),
                "batches": 0 if stats is None else stats.batches,
                "dropped": 0 if stats is None else sum(stats.dropped.values()),
            }
        return out

    async def start(self) -> None:
        if self._running or not self.indexes:
            return
        self._running = True
        self._context = zmq.asyncio.Context()
        if not self._subscribed:
            self.pool.subscribe(self._on_pool_change)
            self._subscribed = True
        bind = self.settings.bind
        if bind is not None:
            self._start_bind(bind)
        for state in self.pool:
            self._watch(state.endpoint)

    def _start_bind(self, bind: str) -> None:
        assert self._context is not None
        if self.keys is not None:
            admit = self._origins.authenticated
        elif self.settings.allow_unauthenticated_bind:
            log.warning(
                "KV events: %s is bound WITHOUT authentication: a message is believed when its "
                "TCP source is the host of the replica its topic names; any process on that "
                "host, or anyone who can spoof it, can steer routing or clear the replica's "
                "blocks. Prefer per-replica sockets (kv_events.port) or kv_events.curve",
                bind,
            )
            admit = self._origins.by_address
        else:
            log.error(
                "KV events: not binding %s: shared bind mode trusts the topic to name the "
                "replica, so it needs kv_events.curve (authenticated publishers) or "
                "kv_events.allow_unauthenticated_bind: true; use kv_events.port for plain "
                "vLLM publishers (docs/cache-routing.md)",
                bind,
            )
            return
        stats = SubscriberStats()
        subscriber = KVEventSubscriber(
            self._context,
            bind,
            _TopicSink(self.pool, self.indexes, stats),
            topic_filter=self.settings.topic_filter,
            name=bind,
            stats=stats,
            bind=True,
            curve=self.keys,
            admit=admit,
        )
        self._launch(bind, subscriber)

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *self._stopping]
        self._tasks.clear()
        self._stopping.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def wait_ready(self, timeout: float = 5.0) -> None:
        """Until every subscriber has connected or bound (tests and benchmarks)."""
        await asyncio.wait_for(
            asyncio.gather(*(s.ready.wait() for s in self.subscribers.values())), timeout
        )

    def stats(self) -> dict[str, SubscriberStats]:
        return {name: s.stats for name, s in self.subscribers.items()}

    def _on_pool_change(self, event: str, state: EndpointState) -> None:
        if not self._running:
            return
        if event == "added":
            self._watch(state.endpoint)
        elif event == "removed":
            self._unwatch(state.address)
            for index in self.indexes:
                index.clear(state.address)
        if self.auto:
            # a replica alone on its host gains or loses the conventional port
            for other in self.pool:
                if other.endpoint.host != state.endpoint.host or other is state:
                    continue
                if other.endpoint.kv_events is not None:
                    continue
                has = other.address in self.subscribers
                if self.resolve(other.endpoint) is None:
                    if has:
                        self._unwatch(other.address)
                elif not has:
                    self._watch(other.endpoint)

    def _watch(self, endpoint: Endpoint) -> None:
        resolved = self.resolve(endpoint)
        if resolved is None or self._context is None:
            return
        self._unwatch(endpoint.address)
        url, replay = resolved
        bound = binds(url)
        keys = self.keys
        if not bound and not self._curve_connects:
            keys = None
        stats = SubscriberStats()
        sink = _EndpointSink(
            endpoint.address,
            self.indexes,
            check_topic=self.auto and endpoint.kv_events is None,
            stats=stats,
        )
        subscriber = KVEventSubscriber(
            self._context,
            url,
            sink,
            stats=stats,
            replay_endpoint=replay,
            topic_filter=self.settings.topic_filter,
            replay_timeout_s=self.settings.replay_timeout_s,
            name=endpoint.address,
            bind=bound,
            curve=keys,
            admit=self._origins.for_replica(endpoint) if bound else None,
            replay_optional=self.replay_optional and endpoint.kv_events_replay is None,
        )
        self._launch(endpoint.address, subscriber)

    def _launch(self, name: str, subscriber: KVEventSubscriber) -> None:
        self.subscribers[name] = subscriber
        task = asyncio.get_running_loop().create_task(subscriber.run(), name=f"kv-events {name}")
        task.add_done_callback(self._task_done)
        self._tasks[name] = task

    def _unwatch(self, name: str) -> None:
        self.subscribers.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._stopping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("KV-event task %s ended: %r", task.get_name(), task.exception())
