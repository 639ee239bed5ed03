"""In-flight snapshots, prefix insertions and shared metrics, on a recording bus."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq

from servegate.pool.endpoint import Endpoint, EndpointMetrics
from servegate.pool.pool import ModelEntry, Pool
from servegate.scaleout.bus import Bus, new_socket
from servegate.scaleout.codec import (
    GONE,
    INFLIGHT,
    METRICS,
    PREFIX,
    EndpointReport,
    InFlight,
    Message,
    PrefixInsert,
    decode,
    encode,
)
from servegate.scaleout.inflight import InFlightSharing
from servegate.scaleout.metrics import MetricsSharing
from servegate.scaleout.prefix import PrefixSharing
from servegate.scaleout.settings import ScaleOutSettings
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import Decision
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.routing_state import ROUTING_STATE_SERVICE, RoutingState

SETTINGS = ScaleOutSettings(heartbeat_s=0.5, expiry_s=2.0, coalesce_s=0.0)
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class RecordingBus(Bus):
    def __init__(self, origin: str = "me/w0.1") -> None:
        super().__init__(origin, new_socket(zmq.PUB), new_socket(zmq.SUB))
        self.published: list[Message] = []

    def publish(self, msg: Message) -> None:
        self.published.append(decode(encode(msg)))

    def receive(self, msg: Message) -> None:
        self.deliver(encode(msg))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def bus() -> AsyncIterator[RecordingBus]:
    b = RecordingBus()
    yield b
    await b.stop()


def make_pool() -> Pool:
    pool = Pool("default")
    for address in (A, B):
        pool.add(Endpoint(address, f"http://{address}"))
    return pool


def snapshot(origin: str, *entries: tuple[str, int, int]) -> Message:
    return Message(INFLIGHT, origin, "default", tuple(InFlight(*e) for e in entries))


def counts(pool: Pool, address: str) -> tuple[int, int, int, int]:
    s = pool.get(address)
    assert s is not None
    return (
        s.local_in_flight_requests,
        s.peer_in_flight_requests,
        s.in_flight_requests,
        s.in_flight_tokens,
    )


@pytest.mark.parametrize(
    ("messages", "expected_a"),
    [
        ([snapshot("p/1", (A, 2, 200))], (1, 2, 3, 210)),
        ([snapshot("p/1", (A, 2, 200)), snapshot("p/1", (A, 1, 50))], (1, 1, 2, 60)),
        ([snapshot("p/1", (A, 2, 200)), snapshot("p/1")], (1, 0, 1, 10)),
        ([snapshot("p/1", (A, 2, 200)), snapshot("p/2", (A, 3, 30))], (1, 5, 6, 240)),
        ([snapshot("p/1", (A, 2, 200)), Message(GONE, "p/1", "*")], (1, 0, 1, 10)),
        ([snapshot("me/w0.1", (A, 9, 900))], (1, 0, 1, 10)),
    ],
    ids=["first", "replaced", "emptied", "two-origins-add", "gone-releases", "own-echo-ignored"],
)
async def test_snapshots_replace_per_origin_and_add_to_local_counts(
    bus: RecordingBus, messages: list[Message], expected_a: tuple[int, int, int, int]
) -> None:
    pool = make_pool()
    sharing = InFlightSharing(bus, SETTINGS, lambda: [pool])
    state = pool.get(A)
    assert state is not None
    pool.acquire(state, 10)
    for msg in messages:
        bus.receive(msg)
    assert counts(pool, A) == expected_a
    assert counts(pool, B) == (0, 0, 0, 0)
    pool.release(state, 10)
    assert counts(pool, A)[0] == 0
    assert counts(pool, A)[2] == expected_a[1]
    del sharing


async def test_a_silent_origin_expires_and_releases_its_counts(bus: RecordingBus) -> None:
    pool = make_pool()
    clock = Clock()
    sharing = InFlightSharing(bus, SETTINGS, lambda: [pool], clock)
    bus.receive(snapshot("p/1", (A, 2, 20)))
    bus.receive(snapshot("p/2", (B, 1, 10)))
    clock.now += 1.5
    bus.receive(snapshot("p/2", (B, 1, 10)))
    clock.now += 1.0
    sharing.expire()
    assert list(sharing.peers) == ["p/2"]
    assert counts(pool, A) == (0, 0, 0, 0)
    assert counts(pool, B) == (0, 1, 1, 10)
    assert sharing.expired == 1


async def test_local_changes_are_published_as_coalesced_snapshots(bus: RecordingBus) -> None:
    pool = make_pool()
    sharing = InFlightSharing(bus, SETTINGS, lambda: [pool])
    sharing.attach()
    state = pool.get(B)
    assert state is not None
    pool.acquire(state, 7)
    pool.acquire(state, 3)
    await asyncio.sleep(0.01)
    assert [m.body for m in bus.published] == [(InFlight(B, 2, 10),)]
    pool.release(state, 7)
    pool.release(state, 3)
    await asyncio.sleep(0.01)
    assert bus.published[-1].body == ()
    await sharing.stop()


def approx_scorer(scheduler_plugins: dict[str, object]) -> PrefixCacheScorer:
    return next(p for p in scheduler_plugins.values() if isinstance(p, PrefixCacheScorer))


async def test_prefix_insertions_are_published_and_remote_ones_inserted_silently(
    bus: RecordingBus,
) -> None:
    pool = make_pool()
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext(staleness_s=2.0))
    sharing = PrefixSharing(bus, SETTINGS)
    sharing.attach([("default", pool, scheduler)])
    scorer = approx_scorer(dict(scheduler.plugins))
    llm = LLMRequest(
        kind=RequestKind.COMPLETION, model="m", body={}, prompt="x" * 640, request_id="r",
        target_model="m", base_model="m",
    )  # fmt: skip
    state = pool.get(A)
    assert state is not None
    scorer.pre_request(llm, Decision(endpoint=state, fallbacks=[]), 0.0)
    await asyncio.sleep(0.01)
    keys = tuple(scorer.block_keys(llm))
    assert len(keys) == 10
    assert [m.kind for m in bus.published] == [PREFIX]
    assert bus.published[0].body == (PrefixInsert(scorer.name, A, None, keys),)

    bus.receive(Message(PREFIX, "p/1", "default", (PrefixInsert(scorer.name, B, None, keys),)))
    bus.receive(Message(PREFIX, "p/1", "other-pool", (PrefixInsert(scorer.name, B, None, keys),)))
    assert scorer.index.match_lengths(keys, [A, B]) == {A: 10, B: 10}
    assert len(bus.published) == 1
    assert (sharing.applied, sharing.unmatched) == (1, 1)
    sharing.stop()
    scorer.pre_request(llm, Decision(endpoint=state, fallbacks=[]), 1.0)
    await asyncio.sleep(0.01)
    assert len(bus.published) == 1  # stopped: the pool's state no longer tells it


async def test_after_a_picker_reload_sharing_follows_the_pools_state_without_patching(
    bus: RecordingBus,
) -> None:
    """The index lives in the pool's routing state: the reloaded scheduler's scorer shares
    it, scale-out stays subscribed once (one publication per insertion), keys the seed on
    the state, and a peer's insertion lands in the index both schedulers read."""
    pool = make_pool()
    state = RoutingState()
    ctx = PluginContext(staleness_s=2.0, services={ROUTING_STATE_SERVICE: state})
    before = load_picker_config(DEFAULT_PICKER_CONFIG, ctx)
    sharing = PrefixSharing(bus, SETTINGS)
    sharing.seed_key = b"k" * 16
    sharing.attach([("default", pool, before)])
    after = load_picker_config(DEFAULT_PICKER_CONFIG, ctx)
    sharing.attach([("default", pool, after)])
    old, new = approx_scorer(dict(before.plugins)), approx_scorer(dict(after.plugins))
    assert new is not old and new.index is old.index
    assert state.seed_key == new.seed_key == b"k" * 16
    llm = LLMRequest(
        kind=RequestKind.COMPLETION, model="m", body={}, prompt="y" * 640, request_id="r",
        target_model="m", base_model="m",
    )  # fmt: skip
    target = pool.get(A)
    assert target is not None
    new.pre_request(llm, Decision(endpoint=target, fallbacks=[]), 0.0)
    await asyncio.sleep(0.01)
    keys = tuple(new.block_keys(llm))
    assert [m.body for m in bus.published] == [(PrefixInsert(new.name, A, None, keys),)]
    bus.receive(Message(PREFIX, "p/1", "default", (PrefixInsert(new.name, B, None, keys),)))
    assert old.index.match_lengths(keys, [A, B]) == {A: len(keys), B: len(keys)}
    sharing.stop()


def report(address: str, healthy: bool, waiting: float) -> EndpointReport:
    return EndpointReport(
        address, healthy, EndpointMetrics(waiting=waiting, scraped_at=5.0), (ModelEntry("m"),)
    )


async def test_a_follower_applies_the_leaders_metrics_health_and_models(bus: RecordingBus) -> None:
    pool = make_pool()

    async def never(on: bool) -> None:
        raise AssertionError("no takeover expected")

    follower = MetricsSharing(bus, SETTINGS, False, lambda: [pool], never)
    bus.receive(
        Message(METRICS, "me/w0.2", "default", (report(A, True, 4.0), report(B, False, 1.0)))
    )
    a, b = pool.get(A), pool.get(B)
    assert a is not None and b is not None
    assert (a.healthy, a.metrics.waiting, a.served_models) == (True, 4.0, frozenset({"m"}))
    assert (b.healthy, b.metrics.waiting) == (False, 1.0)
    assert pool.resolve_model("m") is not None
    assert not follower.scrapes


async def test_a_leader_publishes_what_the_data_layer_writes(bus: RecordingBus) -> None:
    pool = make_pool()

    async def never(on: bool) -> None:
        raise AssertionError("a leader never takes over")

    leader = MetricsSharing(bus, SETTINGS, True, lambda: [pool], never)
    leader.attach()
    pool.set_metrics(A, EndpointMetrics(waiting=7.0, scraped_at=1.0))
    pool.set_health(A, True)
    await asyncio.sleep(0.03)
    assert [m.kind for m in bus.published] == [METRICS]
    (sent,) = bus.published[0].body or ()
    assert isinstance(sent, EndpointReport)
    assert (sent.address, sent.healthy, sent.metrics.waiting) == (A, True, 7.0)
    await leader.stop()


async def test_a_restarted_leader_withholds_endpoints_it_has_not_probed_until_warm(
    bus: RecordingBus,
) -> None:
    pool = make_pool()
    clock = Clock()

    async def never(on: bool) -> None:
        raise AssertionError("a leader never takes over")

    leader = MetricsSharing(bus, SETTINGS, True, lambda: [pool], never, clock)
    leader.publish(pool, pool)
    pool.set_metrics(A, EndpointMetrics(waiting=2.0, scraped_at=1.0))
    leader.publish(pool, pool)
    pool.set_health(A, True)
    leader.publish(pool, pool)
    clock.now += SETTINGS.leader_takeover_s
    leader.publish(pool, pool)
    sent = [[(r.address, r.healthy) for r in m.body or () if isinstance(r, EndpointReport)]
            for m in bus.published]  # fmt: skip
    assert sent == [[], [], [(A, True)], [(A, True), (B, False)]]


async def test_a_follower_takes_over_when_the_leader_is_silent_and_hands_back(
    bus: RecordingBus,
) -> None:
    pool = make_pool()
    clock = Clock()
    calls: list[bool] = []

    async def set_scraping(on: bool) -> None:
        calls.append(on)

    follower = MetricsSharing(bus, SETTINGS, False, lambda: [pool], set_scraping, clock)
    clock.now += SETTINGS.leader_takeover_s - 0.1
    await follower.check_leader()
    assert calls == []
    clock.now += 0.2
    await follower.check_leader()
    assert calls == [True] and follower.scrapes
    bus.receive(Message(METRICS, "me/w0.2", "default", (report(A, True, 1.0),)))
    await follower.check_leader()
    assert calls == [True, False] and not follower.scrapes
