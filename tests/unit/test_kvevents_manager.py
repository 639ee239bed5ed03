"""Which socket each replica's KV events come from, and the subscribers' life cycle."""

from __future__ import annotations

import asyncio
import tempfile

import msgpack
import pytest
import zmq
import zmq.asyncio

from servegate.datalayer.kvevents import EventBatch, KVEventsManager, KVEventsSettings
from servegate.datalayer.kvevents.manager import address_of_topic
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool


class Index:
    def __init__(self) -> None:
        self.applied: list[tuple[str, EventBatch]] = []
        self.cleared: list[str] = []

    def apply(self, address: str, batch: EventBatch) -> None:
        self.applied.append((address, batch))

    def clear(self, address: str) -> None:
        self.cleared.append(address)


def endpoint(address: str = "10.0.0.1:8000", **kw: str | None) -> Endpoint:
    return Endpoint(address=address, url=f"http://{address}", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ep", "settings", "expected"),
    [
        pytest.param(endpoint(), KVEventsSettings(), None, id="nothing-configured"),
        pytest.param(
            endpoint(kv_events="ipc:///tmp/kv.sock"),
            KVEventsSettings(),
            ("ipc:///tmp/kv.sock", None),
            id="explicit-ipc",
        ),
        pytest.param(
            endpoint(kv_events="tcp://10.9.9.9:6000"),
            KVEventsSettings(replay_port=6001),
            ("tcp://10.9.9.9:6000", "tcp://10.9.9.9:6001"),
            id="explicit-tcp-derived-replay",
        ),
        pytest.param(
            endpoint(kv_events="tcp://h:1", kv_events_replay="tcp://h:2"),
            KVEventsSettings(replay_port=9),
            ("tcp://h:1", "tcp://h:2"),
            id="explicit-both",
        ),
        pytest.param(
            endpoint(),
            KVEventsSettings(port=5557, replay_port=5558),
            ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
            id="derived-from-host",
        ),
        pytest.param(
            endpoint(),
            KVEventsSettings(port=5557, bind="tcp://*:5557", allow_unauthenticated_bind=True),
            None,
            id="global-socket-mode-has-no-per-replica-socket",
        ),
    ],
)
def test_resolve(
    ep: Endpoint, settings: KVEventsSettings, expected: tuple[str, str | None] | None
) -> None:
    assert KVEventsManager(Pool(), [Index()], settings).resolve(ep) == expected


@pytest.mark.parametrize(
    ("topic", "address"),
    [
        (b"kv@10.0.0.1:8000@llama", "10.0.0.1:8000"),
        (b"kv@[::1]:8000@m", "[::1]:8000"),
        (b"kv@only-two", None),
        (b"", None),
        (b"kv@@m", None),
        (b"\xff@a:1@m", "a:1"),
    ],
)
def test_address_of_topic(topic: bytes, address: str | None) -> None:
    assert address_of_topic(topic) == address


def payload(ts: float) -> bytes:
    return msgpack.packb([ts, [{"type": "AllBlocksCleared"}], 0])  # type: ignore[no-any-return]


async def test_subscribers_follow_the_pool_and_feed_every_index() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp}/a")
        pool = Pool()
        indexes = [Index(), Index()]
        manager = KVEventsManager(pool, indexes)
        await manager.start()
        try:
            pool.add(endpoint("a:1", kv_events=f"ipc://{tmp}/a"))
            pool.add(endpoint("b:1"))  # no KV events: no subscriber
            assert sorted(manager.subscribers) == ["a:1"]
            await manager.wait_ready()
            for i in range(200):
                await pub.send_multipart([b"kv@a:1@m", i.to_bytes(8, "big"), payload(i)])
                await asyncio.sleep(0.01)
                if indexes[1].applied:
                    break
            assert indexes[0].applied and indexes[0].applied[0][0] == "a:1"
            assert len(indexes[0].applied) == len(indexes[1].applied)
            pool.remove("a:1")
            assert manager.subscribers == {}
            assert all(index.cleared == ["a:1"] for index in indexes)
        finally:
            await manager.stop()
            pub.close(linger=0)
            ctx.destroy(linger=0)


async def test_global_socket_mode_attributes_batches_by_topic() -> None:
    pool = Pool()
    pool.add(endpoint("a:1"))
    index = Index()
    settings = KVEventsSettings(bind="tcp://127.0.0.1:*", allow_unauthenticated_bind=True)
    manager = KVEventsManager(pool, [index], settings)
    await manager.start()
    try:
        await manager.wait_ready()
        (sub,) = manager.subscribers.values()
        assert sub.endpoint == "tcp://127.0.0.1:*"  # one bound socket, no per-replica ones
        sink = sub.stream.sink
        sink.apply(b"kv@a:1@m", EventBatch(1.0, []))
        sink.apply(b"kv@zz:9@m", EventBatch(2.0, []))  # not in the pool
        sink.reset(b"kv@a:1@m")
        assert [a for a, _ in index.applied] == ["a:1"]
        assert index.cleared == ["a:1"]
        assert sub.stats.dropped == {"unknown-topic": 1}
    finally:
        await manager.stop()


async def test_a_manager_without_indexes_starts_nothing() -> None:
    pool = Pool()
    pool.add(endpoint(kv_events="ipc:///tmp/none"))
    manager = KVEventsManager(pool, [])
    await manager.start()
    assert manager.subscribers == {}
    await manager.stop()


async def test_auto_subscribes_replicas_alone_on_their_host_and_follows_the_pool() -> None:
    """llm-d's convention (port 5557) only while a replica is the one pool member on its host."""
    pool = Pool()
    pool.add(endpoint("127.0.0.2:8000"))
    pool.add(endpoint("127.0.0.3:8000"))
    manager = KVEventsManager(pool, [Index()], KVEventsSettings(port=5557), auto=True)
    await manager.start()
    try:
        assert set(manager.subscribers) == {"127.0.0.2:8000", "127.0.0.3:8000"}
        # a second replica on 127.0.0.2: neither can own port 5557 there
        pool.add(endpoint("127.0.0.2:8001"))
        assert set(manager.subscribers) == {"127.0.0.3:8000"}
        # it leaves: the first one is alone again and subscribed again
        pool.remove("127.0.0.2:8001")
        assert set(manager.subscribers) == {"127.0.0.2:8000", "127.0.0.3:8000"}
        status = manager.status()
        assert status["127.0.0.2:8000"]["kv_events"] == "tcp://127.0.0.2:5557"
        assert status["127.0.0.2:8000"]["receiving"] is False
    finally:
        await manager.stop()


async def test_auto_asks_llm_ds_replay_port_and_may_give_it_up() -> None:
    """Nothing configured: the replay socket is llm-d's `tcp://<host>:5558`, a guess that a
    replica may not run (`replay_optional`); one named on the endpoint is always asked."""
    from servegate.datalayer.kvevents.settings import KVEventsSettings, kv_events_settings

    chosen = kv_events_settings({}, KVEventsSettings())
    settings = chosen.settings
    assert (settings.port, settings.replay_port, chosen.auto) == (5557, 5558, True)
    assert chosen.replay_optional
    pinned = kv_events_settings({}, KVEventsSettings(replay_port=7000))
    assert pinned.settings.replay_port == 7000 and not pinned.replay_optional
    pool = Pool()
    pool.add(endpoint("127.0.0.2:8000"))
    pool.add(endpoint("127.0.0.3:8000", kv_events_replay="tcp://127.0.0.3:6000"))
    manager = KVEventsManager(
        pool, [Index()], settings, auto=chosen.auto, replay_optional=chosen.replay_optional
    )
    await manager.start()
    try:
        subs = manager.subscribers
        assert subs["127.0.0.2:8000"].replay_endpoint == "tcp://127.0.0.2:5558"
        assert subs["127.0.0.2:8000"].replay_optional
        assert subs["127.0.0.3:8000"].replay_endpoint == "tcp://127.0.0.3:6000"
        assert not subs["127.0.0.3:8000"].replay_optional
        assert manager.status()["127.0.0.2:8000"]["replay"] == "tcp://127.0.0.2:5558"
    finally:
        await manager.stop()


def test_auto_drops_batches_whose_topic_names_another_replica() -> None:
    from servegate.datalayer.kvevents.manager import _EndpointSink
    from servegate.datalayer.kvevents.transport import SubscriberStats

    index = Index()
    stats = SubscriberStats()
    sink = _EndpointSink("127.0.0.2:8000", [index], check_topic=True, stats=stats)
    batch = EventBatch(0.0, [])
    sink.apply(b"kv@127.0.0.9:8000@m", batch)
    sink.reset(b"kv@127.0.0.9:8000@m")
    sink.apply(b"kv@127.0.0.2:8000@m", batch)
    sink.apply(b"", batch)  # vLLM's default topic names nobody: kept
    assert [a for a, _ in index.applied] == ["127.0.0.2:8000", "127.0.0.2:8000"]
    assert index.cleared == [] and stats.dropped == {"foreign-topic": 2}
