"""KV events from foreign publishers, on real ZeroMQ sockets on loopback.

Issue 18 item 4: in shared `bind` mode the topic named the replica, so a foreign
publisher steered every prompt (BlockStored for prefixes it chose) and could
wipe a replica (`AllBlocksCleared`); and `bind: tcp://127.0.0.1:5557` connected
instead of binding. Loopback has the whole 127.0.0.0/8, so "another host" is a
publisher whose TCP source is 127.0.0.3 while the replica is 127.0.0.2
(`tcp://SOURCE:0;DEST` makes libzmq bind the source address).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pydantic
import pytest
import zmq
import zmq.asyncio

from servegate.curve import CurveKeys, CurveSettings, ZapRegistry, create_keys
from servegate.datalayer.kvevents import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEventsManager,
    KVEventsSettings,
)
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool

REPLICA = "127.0.0.2:8000"
OTHER = "127.0.0.4:8000"
TRIES = 100


class Index:
    def __init__(self) -> None:
        self.applied: list[tuple[str, EventBatch]] = []
        self.cleared: list[str] = []

    def apply(self, address: str, batch: EventBatch) -> None:
        self.applied.append((address, batch))

    def clear(self, address: str) -> None:
        self.cleared.append(address)

    def stored(self) -> set[tuple[str, int]]:
        return {
            (address, h)
            for address, batch in self.applied
            for e in batch.events
            if isinstance(e, BlockStored)
            for h in e.block_hashes
            if isinstance(h, int)
        }

    def wipes(self) -> int:
        return sum(isinstance(e, AllBlocksCleared) for _, b in self.applied for e in b.events)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def payload(block: int, *, clear: bool = False) -> bytes:
    events: list[object] = [["BlockStored", [block], None, [1, 2], 2, None, None]]
    if clear:
        events.append(["AllBlocksCleared"])
    data: bytes = msgpack.packb([1.0, events, None])
    return data


class Publisher:
    def __init__(self, ctx: zmq.asyncio.Context, target: str, source: str | None = None) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        host_port = target.removeprefix("tcp://")
        self.sock.connect(f"tcp://{source}:0;{host_port}" if source else target)
        self.seq = 0

    async def send(self, topic: str, data: bytes) -> None:
        await self.sock.send_multipart([topic.encode(), self.seq.to_bytes(8, "big"), data])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def make_pool() -> Pool:
    pool = Pool()
    for address in (REPLICA, OTHER):
        pool.add(Endpoint(address, f"http://{address}"))
    return pool


@pytest.fixture
async def manager_factory() -> AsyncIterator[list[KVEventsManager]]:
    managers: list[KVEventsManager] = []
    yield managers
    for m in managers:
        await m.stop()


async def started(
    managers: list[KVEventsManager], pool: Pool, index: Index, settings: KVEventsSettings
) -> KVEventsManager:
    manager = KVEventsManager(pool, [index], settings)
    managers.append(manager)
    await manager.start()
    await manager.wait_ready()
    return manager


async def test_a_bind_endpoint_with_an_address_binds(
    ctx: zmq.asyncio.Context, manager_factory: list[KVEventsManager]
) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    index = Index()
    settings = KVEventsSettings(bind=bind, allow_unauthenticated_bind=True)
    pool = Pool()
    pool.add(Endpoint("127.0.0.1:8000", "http://127.0.0.1:8000"))
    manager = await started(manager_factory, pool, index, settings)
    (sub,) = manager.subscribers.values()
    assert sub.bind and sub.bound_endpoint == bind
    with socket.create_connection(("127.0.0.1", int(bind.rsplit(":", 1)[1])), timeout=2):
        pass  # something listens: the subscriber bound instead of connecting
    pub = Publisher(ctx, bind)
    try:
        for i in range(TRIES):
            await pub.send("kv@127.0.0.1:8000@m", payload(i))
            await asyncio.sleep(0.05)
            if index.applied:
                break
        assert index.applied and index.applied[0][0] == "127.0.0.1:8000"
    finally:
        pub.close()


async def test_unauthenticated_bind_believes_only_the_replicas_own_address(
    ctx: zmq.asyncio.Context, manager_factory: list[KVEventsManager]
) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    index = Index()
    settings = KVEventsSettings(bind=bind, allow_unauthenticated_bind=True)
    manager = await started(manager_factory, make_pool(), index, settings)
    (sub,) = manager.subscribers.values()
    honest = Publisher(ctx, bind, source="127.0.0.2")
    foreign = Publisher(ctx, bind, source="127.0.0.3")

    def all_heard() -> bool:
        dropped = sub.stats.dropped
        return (
            bool(index.applied)
            and dropped.get("wrong-origin", 0) >= 2
            and (dropped.get("unknown-topic", 0) >= 1)
        )

    try:
        for i in range(TRIES):
            # the foreign publisher names the replica, starts over (seq 0: a "restart"
            # would wipe it) and clears everything; then the replica itself speaks
            await foreign.send(f"kv@{REPLICA}@m", payload(1000 + i, clear=True))
            await foreign.send(f"kv@{OTHER}@m", payload(2000 + i, clear=True))
            await foreign.send("kv@10.9.9.9:1@m", payload(3000 + i))
            await honest.send(f"kv@{REPLICA}@m", payload(i))
            await asyncio.sleep(0.05)
            if all_heard():
                break
        assert index.applied, "the replica's own events must arrive"
        assert all(address == REPLICA for address, _ in index.applied)
        assert all(h < 1000 for _, h in index.stored())
        assert index.wipes() == 0 and index.cleared == []
        assert sub.stats.dropped.get("wrong-origin", 0) >= 2
        assert sub.stats.dropped.get("unknown-topic", 0) >= 1
    finally:
        honest.close()
        foreign.close()


@pytest.fixture
def keys(tmp_path: Path) -> tuple[CurveSettings, CurveKeys, CurveKeys]:
    """The gateway's settings, an authorized publisher (a relay) and an unauthorized one."""
    _, gateway_secret = create_keys(str(tmp_path / "gateway"))
    relay_public, relay_secret = create_keys(str(tmp_path / "relay"))
    _, stranger_secret = create_keys(str(tmp_path / "stranger"))
    gateway_public = str(tmp_path / "gateway" / "bus.key")
    settings = CurveSettings(
        secret_key_file=str(gateway_secret), authorized_keys=(str(relay_public),)
    )

    def client(secret: Path) -> CurveKeys:
        return CurveKeys.load(
            CurveSettings(secret_key_file=str(secret), server_key_file=gateway_public)
        )

    return settings, client(relay_secret), client(stranger_secret)


async def test_curve_bind_hears_only_authorized_publishers(
    ctx: zmq.asyncio.Context,
    manager_factory: list[KVEventsManager],
    keys: tuple[CurveSettings, CurveKeys, CurveKeys],
) -> None:
    settings, relay_keys, stranger_keys = keys
    bind = f"tcp://127.0.0.1:{free_port()}"
    index = Index()
    manager = await started(
        manager_factory, make_pool(), index, KVEventsSettings(bind=bind, curve=settings)
    )
    (sub,) = manager.subscribers.values()
    relay = ctx.socket(zmq.PUB)
    relay_keys.client(relay)
    relay.connect(bind)
    stranger = ctx.socket(zmq.PUB)
    stranger_keys.client(stranger)
    stranger.connect(bind)
    plain = Publisher(ctx, bind)
    try:
        for i in range(TRIES):
            seq = i.to_bytes(8, "big")
            topic = f"kv@{REPLICA}@m".encode()
            await stranger.send_multipart([topic, seq, payload(1000 + i, clear=True)])
            await plain.send(f"kv@{REPLICA}@m", payload(2000 + i, clear=True))
            await relay.send_multipart([topic, seq, payload(i)])
            await asyncio.sleep(0.05)
            if index.applied and sub.refused >= 1:
                break
        assert sub.refused >= 1  # the stranger's key was turned away by ZAP
        assert index.applied and all(h < 1000 for _, h in index.stored())
        assert index.wipes() == 0
        assert sub.stats.messages == sum(1 for _ in index.applied) + sum(sub.stats.dropped.values())
    finally:
        relay.close(0)
        stranger.close(0)
        plain.close()


async def test_per_replica_sockets_trust_the_connection_not_the_topic(
    ctx: zmq.asyncio.Context, manager_factory: list[KVEventsManager]
) -> None:
    """The default for plain vLLM: the gateway connects to the replica's own socket, so a
    topic naming another replica still counts for the one that sent it."""
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    pool = Pool()
    pool.add(
        Endpoint("127.0.0.1:8000", "http://127.0.0.1:8000", kv_events=f"tcp://127.0.0.1:{port}")
    )
    pool.add(Endpoint(OTHER, f"http://{OTHER}"))
    index = Index()
    await started(manager_factory, pool, index, KVEventsSettings())
    try:
        for i in range(TRIES):
            await pub.send_multipart([f"kv@{OTHER}@m".encode(), i.to_bytes(8, "big"), payload(i)])
            await asyncio.sleep(0.05)
            if index.applied:
                break
        assert index.applied and {a for a, _ in index.applied} == {"127.0.0.1:8000"}
    finally:
        pub.close(0)


async def test_bind_without_curve_or_an_explicit_allow_stays_off(
    manager_factory: list[KVEventsManager],
) -> None:
    with pytest.raises(pydantic.ValidationError, match="allow_unauthenticated_bind"):
        KVEventsSettings(bind="tcp://*:5557")
    KVEventsSettings(bind="tcp://*:5557", allow_unauthenticated_bind=True)
    index = Index()
    # what llm-d's zmqEndpoint becomes (kv_events_settings copies it in without validating)
    unauthenticated = KVEventsSettings().model_copy(
        update={"bind": f"tcp://127.0.0.1:{free_port()}"}
    )
    manager = KVEventsManager(make_pool(), [index], unauthenticated)
    manager_factory.append(manager)
    await manager.start()
    assert manager.subscribers == {}  # llm-d's zmqEndpoint path: refused with an error log


async def test_per_replica_sockets_speak_curve_only_to_a_named_relay_key(
    ctx: zmq.asyncio.Context, manager_factory: list[KVEventsManager], tmp_path: Path
) -> None:
    """`curve.server_key_file` set: the gateway is a CURVE client of the relay in front of
    each engine; without it per-replica sockets stay plain, as vLLM publishes."""
    gateway_public, gateway_secret = create_keys(str(tmp_path / "gateway"))
    relay_public, relay_secret = create_keys(str(tmp_path / "relay"))
    relay_keys = CurveKeys.load(
        CurveSettings(secret_key_file=str(relay_secret), authorized_keys=(str(gateway_public),))
    )
    relay_port, plain_port = free_port(), free_port()
    relay = ctx.socket(zmq.PUB)
    domain = ZapRegistry.server(relay, relay_keys)
    relay.bind(f"tcp://127.0.0.1:{relay_port}")
    plain = ctx.socket(zmq.PUB)
    plain.bind(f"tcp://127.0.0.1:{plain_port}")

    def pool_of(port: int) -> Pool:
        pool = Pool()
        address = "127.0.0.1:8000"
        pool.add(Endpoint(address, f"http://{address}", kv_events=f"tcp://127.0.0.1:{port}"))
        return pool

    via_relay, via_plain = Index(), Index()
    with_server = CurveSettings(
        secret_key_file=str(gateway_secret), server_key_file=str(relay_public)
    )
    bind_only = CurveSettings(secret_key_file=str(gateway_secret))
    await started(
        manager_factory, pool_of(relay_port), via_relay, KVEventsSettings(curve=with_server)
    )
    await started(
        manager_factory, pool_of(plain_port), via_plain, KVEventsSettings(curve=bind_only)
    )
    try:
        for i in range(TRIES):
            frames = [b"kv@127.0.0.1:8000@m", i.to_bytes(8, "big"), payload(i)]
            await relay.send_multipart(frames)
            await plain.send_multipart(frames)
            await asyncio.sleep(0.05)
            if via_relay.applied and via_plain.applied:
                break
        assert via_relay.applied and via_plain.applied
    finally:
        relay.close(0)
        plain.close(0)
        ZapRegistry.release(domain)
