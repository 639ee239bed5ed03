"""Issue 18 item 12: a 100 kB model name (or path) is neither logged nor echoed in full."""

from __future__ import annotations

import aiohttp

from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import Replica, gateway_config, ready

HUGE = "m" * 100_000


async def test_a_huge_model_name_is_clipped_in_the_error_and_the_log(
    http: aiohttp.ClientSession,
) -> None:
    replica = await Replica().start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            body = {"model": HUGE, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 404
                error = (await resp.json())["error"]
                assert error["code"] == "model_not_found"
                assert len(error["message"]) < 1000
                assert "more characters" in error["message"]
            async with http.get(gw.url + "/v1/" + "x" * 6000) as resp:
                assert resp.status == 404
                assert len(await resp.read()) < 1000
            (line,) = gw.access_lines()
            assert len(line["model"]) < 1000
            assert len(line["error"]) < 1000
            assert len(gw.access_stream.getvalue()) < 5000
    finally:
        await replica.stop()
