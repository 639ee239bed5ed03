"""servegate on a local Ray Serve: the gateway answers, routes across model-server
replicas by their own metrics, and the replicas scale up on the engines' load."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.backends.conftest import free_port, start, stop_group, tail, wait_ready

pytestmark = pytest.mark.backends

APP = Path(__file__).with_name("ray_app.yaml")
ADMIN = {"authorization": "Bearer test-admin"}


async def pool_state(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/admin/pool", headers=ADMIN) as resp:
        assert resp.status == 200
        state: dict[str, Any] = await resp.json()
        return state


async def completion(session: aiohttp.ClientSession, base: str, max_tokens: int) -> int:
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": max_tokens}
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        tokens: int = data["usage"]["completion_tokens"]
        return tokens


async def test_gateway_routes_across_autoscaled_replicas(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "ray.log"
    module = "servegate.integrations.ray_serve"
    args = ["--serve-config", str(APP), "--port", str(port), "--num-cpus", "4"]
    proc = start([sys.executable, "-m", module, *args], log)
    try:
        await wait_ready(f"{base}/ready", proc, log, timeout_s=180)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            assert await completion(session, base, 4) == 4
            assert (await pool_state(session, base))["ready_endpoints"] == 1

            load = [asyncio.create_task(completion(session, base, 80)) for _ in range(16)]
            grown = 0
            async with asyncio.timeout(90):
                while grown < 2:
                    await asyncio.sleep(0.5)
                    grown = (await pool_state(session, base))["ready_endpoints"]
            assert await asyncio.gather(*load) == [80] * 16

            after = [asyncio.create_task(completion(session, base, 20)) for _ in range(8)]
            assert await asyncio.gather(*after) == [20] * 8
            state = await pool_state(session, base)
            picked = [e for e in state["endpoints"] if e["picks"] > 0]
            assert len(picked) >= 2, state
    finally:
        stop_group(proc)
    assert proc.returncode == 0, tail(log)
