"""Issue 18: a replica that fails after a stream's headers but before its first content
chunk (vLLM sends the headers at once) is retried on a fallback, with no byte sent twice;
one that fails after content went out ends the stream with an error event, not a retry."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "prompt": "hi", "stream": True}
ROUND_ROBIN = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "round-robin-picker"}],
}
CHUNK = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'


def dies(after: bytes, how: str) -> Any:
    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if after:
            await response.write(after)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        if how == "close":
            request.transport.close()
            await asyncio.sleep(0.05)
            return response
        await response.write_eof()  # "empty": a clean end with no event
        return response

    return answer


@pytest.mark.parametrize("how", ["close", "empty"])
async def test_a_stream_that_fails_before_content_moves_to_a_fallback(
    http: aiohttp.ClientSession, how: str
) -> None:
    bad, good = await Replica(dies(b"", how)).start(), await Replica().start()
    try:
        cfg = gateway_config([bad.url, good.url], ROUND_ROBIN, max_retries=1)
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            bodies = []
            for _ in range(2):
                async with http.post(gw.url + "/v1/completions", json=CHAT) as resp:
                    assert resp.status == 200
                    bodies.append(await resp.read())
            good_stream = (
                b"".join(
                    b"data: " + orjson.dumps({"choices": [{"index": 0, "text": t}]}) + b"\n\n"
                    for t in ("a", "b")
                )
                + b"data: [DONE]\n\n"
            )
            assert bodies == [good_stream, good_stream]
            # round robin: at least one request started on the bad replica, and each that
            # did was retried once
            assert sum(line["retries"] for line in gw.access_lines()) == len(bad.calls) >= 1
    finally:
        await bad.stop()
        await good.stop()


async def test_a_stream_that_fails_after_content_is_not_retried(
    http: aiohttp.ClientSession,
) -> None:
    bad, good = await Replica(dies(CHUNK, "close")).start(), await Replica().start()
    try:
        cfg = gateway_config([bad.url, good.url], ROUND_ROBIN, max_retries=1)
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            bodies = []
            for _ in range(2):
                async with http.post(gw.url + "/v1/completions", json=CHAT) as resp:
                    assert resp.status == 200
                    bodies.append(await resp.read())
            broken = [b for b in bodies if b.startswith(CHUNK)]
            assert len(broken) == len(bad.calls) >= 1
            for body in broken:
                assert body.count(CHUNK) == 1
                assert b'"type":"bad_gateway_error"' in body
                assert b"[DONE]" not in body
            assert len(good.calls) == 2 - len(bad.calls)
            assert all(line["retries"] == 0 for line in gw.access_lines())
    finally:
        await bad.stop()
        await good.stop()
