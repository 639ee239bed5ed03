"""Hostile state on the scale-out bus: huge counts, foreign addresses, floods, spoofed
leaders, oversized messages, guessable prefix keys, and the ipc hub's permissions.

Reproduces issue 18 item 5: an in-flight count of 2^64-1 moved traffic away, 1M
prefix keys for a non-pool address with a capacity of 2^64-1 grew RSS by 415 MB
for good, and followers applied METRICS reports from any origin.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import zmq

from servegate.pool.endpoint import Endpoint, EndpointMetrics
from servegate.pool.pool import Pool
from servegate.pool.sanity import MAX_IN_FLIGHT
from servegate.scaleout.bus import Bus, new_socket
from servegate.scaleout.codec import (
    INFLIGHT,
    MAX_MESSAGE_BYTES,
    METRICS,
    PREFIX,
    VERSION,
    EndpointReport,
    InFlight,
    Message,
    PrefixInsert,
    encode,
)
from servegate.scaleout.hub import Hub
from servegate.scaleout.inflight import InFlightSharing
from servegate.scaleout.metrics import MetricsSharing
from servegate.scaleout.prefix import PrefixSharing
from servegate.scaleout.replica import LINK_MAX_BYTES, ReplicaLink
from servegate.scaleout.settings import ScaleOutSettings
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
OUTSIDE = "203.0.113.9:8000"
SETTINGS = ScaleOutSettings(heartbeat_s=0.5, expiry_s=2.0, coalesce_s=0.0, max_peers=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_pool() -> Pool:
    pool = Pool("default")
    for address in (A, B):
        pool.add(Endpoint(address, f"http://{address}"))
    return pool


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    b = Bus("me/w1.1", new_socket(zmq.PUB), new_socket(zmq.SUB))
    yield b
    await b.stop()


def raw_inflight(origin: str, address: str, requests: int, tokens: int) -> bytes:
    body = [[address, requests, tokens]]
    data: bytes = msgpack.packb([VERSION, INFLIGHT, origin, "default", 0, body])
    return data


def test_an_in_flight_count_of_2_64_minus_1_is_refused(bus: Bus) -> None:
    pool = make_pool()
    sharing = InFlightSharing(bus, SETTINGS, lambda: [pool])
    bus.deliver(raw_inflight("evil/0", A, (1 << 64) - 1, (1 << 64) - 1))
    bus.deliver(raw_inflight("evil/0", A, MAX_IN_FLIGHT + 1, 0))
    state = pool.get(A)
    assert state is not None
    assert (state.peer_in_flight_requests, state.in_flight_requests) == (0, 0)
    assert bus.stats.invalid == 2
    assert sharing.peers == {}
    # the pool caps what it stores whoever calls it
    pool.set_peer_in_flight(A, (1 << 64) - 1, -5)
    assert (state.peer_in_flight_requests, state.peer_in_flight_tokens) == (MAX_IN_FLIGHT, 0)


def test_in_flight_state_only_for_pool_members_known_pools_and_few_origins(bus: Bus) -> None:
    pool = make_pool()
    sharing = InFlightSharing(bus, SETTINGS, lambda: [pool])
    bus.deliver(encode(Message(INFLIGHT, "p/0", "default", (InFlight(OUTSIDE, 5, 5),))))
    bus.deliver(encode(Message(INFLIGHT, "p/0", "nowhere", (InFlight(A, 5, 5),))))
    for i in range(1000):
        bus.deliver(encode(Message(INFLIGHT, f"flood/{i}", "default", (InFlight(A, 1, 1),))))
    assert sharing.rejected["address"] == 1
    assert sharing.rejected["pool"] == 1
    assert len(sharing.peers) == SETTINGS.max_peers
    assert sharing.rejected["peers"] == 1001 - SETTINGS.max_peers
    assert all(OUTSIDE not in c for v in sharing.peers.values() for c in v.pools.values())
    state = pool.get(A)
    assert state is not None and state.peer_in_flight_requests == SETTINGS.max_peers - 1


def scheduler_and_scorer() -> tuple[Scheduler, PrefixCacheScorer]:
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext(staleness_s=2.0))
    scorer = next(p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer))
    return scheduler, scorer


def test_a_million_prefix_keys_for_a_foreign_address_use_no_memory(bus: Bus) -> None:
    pool = make_pool()
    scheduler, scorer = scheduler_and_scorer()
    sharing = PrefixSharing(bus, SETTINGS)
    sharing.attach([("default", pool, scheduler)])
    per = scorer.params.max_prefix_blocks_to_match
    huge_capacity: bytes = msgpack.packb(
        [VERSION, PREFIX, "evil/0", "default", 0, [[scorer.name, A, (1 << 64) - 1, [1, 2]]]]
    )
    bus.deliver(huge_capacity)
    assert bus.stats.invalid == 1
    key = 0
    for _ in range(1_000_000 // per):
        keys = tuple(range(key, key + per))
        key += per
        bus.deliver(encode(Message(PREFIX, "evil/0", "default",
                                   (PrefixInsert(scorer.name, OUTSIDE, 1 << 24, keys),))))  # fmt: skip
    assert len(scorer.index) == 0
    assert sharing.rejected["address"] == 1_000_000 // per
    too_many = tuple(range(per + 1))
    bus.deliver(encode(Message(PREFIX, "evil/0", "default",
                               (PrefixInsert(scorer.name, A, None, too_many),))))  # fmt: skip
    assert sharing.rejected["keys"] == 1


def test_prefix_memory_per_pool_member_is_the_local_capacity_whatever_the_peer_claims(
    bus: Bus,
) -> None:
    pool = make_pool()
    scheduler, scorer = scheduler_and_scorer()
    sharing = PrefixSharing(bus, SETTINGS)
    sharing.attach([("default", pool, scheduler)])
    per = scorer.params.max_prefix_blocks_to_match
    capacity = scorer.params.lru_capacity_per_server
    total = 3 * capacity
    for start in range(0, total, per):
        keys = tuple(range(start, start + per))
        bus.deliver(encode(Message(PREFIX, "evil/0", "default",
                                   (PrefixInsert(scorer.name, A, 1 << 24, keys),))))  # fmt: skip
    assert len(scorer.index) == capacity


def test_followers_apply_metrics_only_from_their_own_leader(bus: Bus) -> None:
    pool = make_pool()

    async def never(on: bool) -> None:
        raise AssertionError("no takeover expected")

    follower = MetricsSharing(bus, SETTINGS, False, lambda: [pool], never)
    lie = EndpointReport(A, False, EndpointMetrics(waiting=999.0, scraped_at=1.0), ())
    for origin in ("evil/w0.1", "me/w1.2", "me/w0", "mex/w0.1"):
        bus.deliver(encode(Message(METRICS, origin, "default", (lie,))))
    bus.deliver(encode(Message(METRICS, "me/w0.3", "default", (lie,), hops=1)))
    state = pool.get(A)
    assert state is not None and state.metrics.waiting == 0.0
    assert follower.rejected == 5
    truth = EndpointReport(A, True, EndpointMetrics(waiting=3.0, scraped_at=1.0), ())
    bus.deliver(encode(Message(METRICS, "me/w0.3", "default", (truth,))))
    assert (state.healthy, state.metrics.waiting) == (True, 3.0)


async def test_oversized_messages_from_a_peer_never_reach_a_handler() -> None:
    """Up to `LINK_MAX_BYTES` the decoder refuses them (and the link stays up); beyond it
    libzmq drops the frame before buffering it (`MAXMSGSIZE` on the link's SUB)."""
    own, peer = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    link = ReplicaLink(ScaleOutSettings(bind=own, peers=(peer,)))
    fake = new_socket(zmq.PUB)
    fake.bind(peer)
    await link.start()
    bus = Bus("me/0", link.pub, link.sub)
    seen: list[int] = []
    bus.on(INFLIGHT, lambda msg: seen.append(len(msg.body or ())))
    bus.start()
    small = raw_inflight("x/0", A, 1, 1)
    big = small + b"\0" * (MAX_MESSAGE_BYTES + 1)
    try:
        for _ in range(60):
            await fake.send(big)
            await fake.send(small)
            await asyncio.sleep(0.05)
            if seen:
                break
        assert seen and all(n == 1 for n in seen)
        assert bus.stats.invalid >= 1  # the 4 MB ones were read and refused
        refused = bus.stats.invalid
        await fake.send(small + b"\0" * (LINK_MAX_BYTES + 1))
        await asyncio.sleep(0.5)
        assert bus.stats.invalid == refused  # never read: libzmq dropped it
    finally:
        fake.close(0)
        await bus.stop()
        await link.stop()


def test_prefix_keys_are_keyed_with_the_shared_secret(bus: Bus, tmp_path: Path) -> None:
    secret = tmp_path / "prefix.key"
    secret.write_bytes(os.urandom(32).hex().encode())
    keyed = ScaleOutSettings(prefix_key_file=str(secret))
    request = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt="guess me " * 100)
    keys = []
    for settings in (SETTINGS, keyed, keyed):
        scheduler, scorer = scheduler_and_scorer()
        PrefixSharing(bus, settings).attach([("default", make_pool(), scheduler)])
        keys.append(scorer.block_keys(replace(request, cache={})))
    plain, first, second = keys
    assert first == second  # every replica with the same secret computes the same keys
    assert not set(first) & set(plain)  # a listener hashing the guessed prompt finds nothing
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PrefixSharing(bus, ScaleOutSettings(prefix_key_file=str(short)))


async def test_the_ipc_hub_is_owner_only(tmp_path: Path) -> None:
    directory = tmp_path / "hub"
    directory.mkdir(mode=0o755)
    hub = Hub(str(directory), "me", None)
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for name in ("bus-in", "bus-out"):
            assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    finally:
        await hub.stop()
