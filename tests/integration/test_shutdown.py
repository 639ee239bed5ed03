"""Graceful shutdown and probes that a busy request path cannot starve."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request

import aiohttp
import pytest

from servegate.gateway.probes import ProbeServer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, chat, gateway_config, wait_ready
from tests.integration.subprocess_gateway import SubprocessGateway

LONG_STREAM_SIM = {**FAST_SIM, "speed": 1.0}


async def connect_refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def test_sigterm_stops_accepting_and_drains_the_stream() -> None:
    async with SimCluster(1, base=LONG_STREAM_SIM) as cluster:
        cfg = gateway_config(cluster.urls, drain_timeout_s=20.0)
        async with SubprocessGateway(cfg, ready_endpoints=1) as gw, aiohttp.ClientSession() as s:
            body = chat(stream=True, max_tokens=300)
            async with s.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                assert gw.proc is not None
                gw.proc.send_signal(signal.SIGTERM)
                refused_at = None
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    if await connect_refused(gw.port):
                        refused_at = time.monotonic()
                        break
                    await asyncio.sleep(0.02)
                rest = await resp.read()
            code = await asyncio.wait_for(gw.proc.wait(), 20.0)
    assert refused_at is not None, "the listening socket stayed open after SIGTERM"
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    assert code == 0


def probe(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10.0) as resp:
        return int(resp.status)


async def test_probe_port_answers_while_the_event_loop_is_blocked() -> None:
    async with SimCluster(1, base=FAST_SIM) as cluster:
        cfg = gateway_config(cluster.urls, probe_port=0)
        async with GatewayRunner(cfg) as gw:
            await wait_ready(gw, 1)
            probes = gw.running.probes
            assert isinstance(probes, ProbeServer)
            answers: list[tuple[str, int]] = []

            def ask() -> None:
                for path in ("/health", "/ready"):
                    answers.append((path, probe(probes.port, path)))

            thread = threading.Thread(target=ask)
            thread.start()
            # blocks the gateway's event loop until both answers came (or the bound passed)
            thread.join(60.0)
            answered_while_blocked = not thread.is_alive()
    assert answered_while_blocked, "the probe port waited for the blocked event loop"
    assert answers == [("/health", 200), ("/ready", 200)]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({"X-Big": "a" * 10_000}, 400, id="field-too-large"),
        pytest.param({f"X-H{i}": "v" for i in range(200)}, 400, id="too-many-headers"),
    ],
)
async def test_header_limits(headers: dict[str, str], status: int) -> None:
    async with (
        SimCluster(1, base=FAST_SIM) as cluster,
        GatewayRunner(gateway_config(cluster.urls)) as gw,
        aiohttp.ClientSession() as session,
    ):
        await wait_ready(gw, 1)
        async with session.post(
            gw.url + "/v1/chat/completions", json=chat(), headers=headers
        ) as resp:
            assert resp.status == status
