"""Two gateway replicas configured with `scaleout.curve` (one shared key pair, as one
Kubernetes Secret would give) and `scaleout.prefix_key_file`: they share in-flight counts
and keyed prefix insertions, and a subscriber without the keys reads nothing."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq

from servegate.curve import create_keys
from servegate.scaleout.bus import new_socket
from servegate.scaleout.wiring import ScaleOut
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, chat, gateway_config, wait_for, wait_ready
from tests.integration.subprocess_gateway import free_port

PROMPT = "the quick brown fox jumps over the lazy dog " * 20


def scaleout(gw: GatewayRunner) -> ScaleOut:
    current = gw.running.scaleout
    assert current is not None
    return current


def approx(gw: GatewayRunner) -> PrefixCacheScorer:
    return next(
        p for p in gw.gateway.scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)
    )


@pytest.fixture
async def sims() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, base=FAST_SIM) as c:
        yield c


async def test_curve_replicas_share_state_and_a_keyless_listener_reads_nothing(
    sims: SimCluster, tmp_path: Path
) -> None:
    _, secret = create_keys(str(tmp_path / "mesh"))
    prefix_key = tmp_path / "prefix.key"
    prefix_key.write_bytes(os.urandom(32).hex().encode())
    a, b = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))

    def config(bind: str) -> dict[str, object]:
        cfg = gateway_config(sims.urls)
        cfg["scaleout"] = {
            "bind": bind, "peers": [a, b], "heartbeat_s": 0.1, "expiry_s": 0.5,
            "curve": {"secret_key_file": str(secret)}, "prefix_key_file": str(prefix_key),
        }  # fmt: skip
        return cfg

    listener = new_socket(zmq.SUB)
    listener.connect(a)
    heard: list[bytes] = []
    try:
        async with GatewayRunner(config(a)) as ga, GatewayRunner(config(b)) as gb:
            await wait_ready(ga, 2)
            await wait_ready(gb, 2)
            await wait_for(
                lambda: (
                    len(scaleout(ga).inflight.peers) == 1 and len(scaleout(gb).inflight.peers) == 1
                ),
                what="CURVE replicas hear each other",
            )
            assert scaleout(ga).describe(0.0)["authenticated"] is True
            async with (
                aiohttp.ClientSession() as session,
                session.post(ga.url + "/v1/chat/completions", json=chat(PROMPT)) as r,
            ):
                assert r.status == 200
            await wait_for(lambda: len(approx(gb).index) > 0, what="B gets A's insertion")
            assert approx(ga).seed_key == approx(gb).seed_key == prefix_key.read_bytes().strip()
            # heartbeats went out every 0.1 s all along: a plaintext link would have queued
            # dozens of them for this subscriber by now
            while await listener.poll(0):
                heard.append(await listener.recv())
    finally:
        listener.close(0)
    assert heard == []
