"""Every fault the simulator can inject, observed over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.testing.cluster import SimCluster, SimHandle

BASE: dict[str, Any] = {
    "model": "tiny",
    "num_blocks": 65,
    "block_size": 4,
    "max_model_len": 256,
    "speed": 50.0,
}
COMPLETION = {"prompt": "hello there", "max_tokens": 4}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def sim() -> AsyncIterator[SimHandle]:
    async with SimCluster(1, base=BASE) as cluster:
        yield cluster[0]


async def fault(http: aiohttp.ClientSession, sim: SimHandle, **body: Any) -> dict[str, Any]:
    async with http.post(sim.url + "/admin/fault", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def eventually(check: Any, tries: int = 300) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


@pytest.mark.parametrize(
    ("status", "err_type"),
    [
        pytest.param(503, "ServiceUnavailableError", id="503"),
        pytest.param(429, "RateLimitError", id="429"),
        pytest.param(500, "InternalServerError", id="500"),
        pytest.param(502, "BadGatewayError", id="502"),
    ],
)
async def test_x_return_error_header(
    sim: SimHandle, http: aiohttp.ClientSession, status: int, err_type: str
) -> None:
    headers = {"X-Return-Error": str(status)}
    async with http.post(sim.url + "/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == (err_type, status)
    assert sim.engine.stats.requests_received == 0


async def test_error_rate_injects_configured_kinds(http: aiohttp.ClientSession) -> None:
    base = {**BASE, "faults": {"error_rate": 1.0, "error_kinds": [429]}}
    async with SimCluster(1, base=base) as cluster:
        for _ in range(3):
            async with http.post(cluster.urls[0] + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 429
        assert cluster[0].state.faults.injected == 3


async def test_disconnect_kind(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.ClientError):
        async with http.post(
            sim.url + "/v1/completions", json=COMPLETION, headers={"X-Return-Error": "disconnect"}
        ) as resp:
            await resp.read()


async def test_stream_error_event_then_done(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    body = {**COMPLETION, "stream": True}
    async with http.post(
        sim.url + "/v1/completions", json=body, headers={"X-Return-Error": "stream_error"}
    ) as resp:
        assert resp.status == 200
        events = (await resp.text()).split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert "choices" in orjson.loads(events[0].removeprefix("data: "))
    await eventually(lambda: sim.engine.num_running == 0)


async def test_stream_cut(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    body = {**COMPLETION, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            sim.url + "/v1/completions", json=body, headers={"X-Return-Error": "stream_cut"}
        ) as resp:
            await resp.read()
    await eventually(lambda: sim.engine.num_running == 0)


async def test_unavailable_then_back(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    assert (await fault(http, sim, mode="unavailable"))["mode"] == "unavailable"
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    async with http.post(sim.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "ServiceUnavailableError"
    await fault(http, sim, mode="none")
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200


async def test_unavailable_reverts_after_duration(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    await fault(http, sim, mode="unavailable", duration_s=0.05)

    async def healthy() -> bool:
        async with http.get(sim.url + "/health") as resp:
            return resp.status == 200

    assert not await healthy()
    for _ in range(300):
        if await healthy():
            break
        await asyncio.sleep(0.01)
    assert await healthy()


async def test_hang_stalls_requests_and_streams(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    stream = await http.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stream": True}
    )
    await stream.content.readuntil(b"\n\n")
    await fault(http, sim, mode="hang")
    generated = sim.engine.stats.generation_tokens
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(sim.url + "/health", timeout=aiohttp.ClientTimeout(total=0.1)):
            pass
    await asyncio.sleep(0.05)
    assert sim.engine.stats.generation_tokens <= generated + 1
    await fault(http, sim, mode="none")
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
    assert (await stream.text()).endswith("data: [DONE]\n\n")


async def test_slow_multiplies_step_time(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    await fault(http, sim, mode="slow", factor=4)
    assert sim.engine.slow_factor == 4
    async with http.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}
    ) as resp:
        assert resp.status == 200
    # one decode-free prefill step of 1 token: (0.004 + 1 x 0.00004) / 50 x 4
    assert sim.engine.stats.last_step_s == pytest.approx(0.004 * 4 / 50 + 0.00004 * 4 / 50)
    await fault(http, sim, mode="none")
    assert sim.engine.slow_factor == 1


async def test_crash_drops_connections_and_stops_listening(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    stream = await http.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True}
    )
    await stream.content.readuntil(b"\n\n")
    assert await fault(http, sim, mode="crash") == {"mode": "crash", "exit": False}
    with pytest.raises(aiohttp.ClientPayloadError):
        await stream.read()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(sim.url + "/health") as resp:
            await resp.read()
    assert not sim.engine.alive


@pytest.mark.parametrize(
    ("path", "starting_status"),
    [pytest.param("/health", 503, id="vllm-health"), pytest.param("/v1/models", 503, id="api")],
)
async def test_startup_delay_answers_503_first(
    http: aiohttp.ClientSession, path: str, starting_status: int
) -> None:
    base = {**BASE, "faults": {"startup_delay_s": 0.2}}
    async with SimCluster(1, base=base) as cluster:
        url = cluster.urls[0] + path
        async with http.get(url) as resp:
            assert resp.status == starting_status
        for _ in range(300):
            async with http.get(url) as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.01)
        assert resp.status == 200


async def test_startup_delay_without_listening_refuses(http: aiohttp.ClientSession) -> None:
    base = {**BASE, "faults": {"startup_delay_s": 0.2, "startup_listen": False}}
    async with SimCluster(1, base=base) as cluster:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(cluster.urls[0] + "/health"):
                pass
        status = 0
        for _ in range(300):
            try:
                async with http.get(cluster.urls[0] + "/health") as resp:
                    status = resp.status
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.01)
        assert status == 200


async def test_bad_fault_command(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/admin/fault", json={"mode": "explode"}) as resp:
        assert resp.status == 400
        assert "mode must be one of" in (await resp.json())["error"]["message"]


async def test_handle_fault_helper(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    sim.fault("unavailable")
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    sim.fault("none")
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
