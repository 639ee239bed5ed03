"""Issue 18 item 1: a client's `kv_transfer_params` never reach a replica; only the gateway sets them.

In vLLM's NIXL connector these fields say where the engine pulls KV blocks from.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from servegate.testing.gateway import GatewayRunner
from tests.disagg_pickers import PD_HANDLER, disagg_picker
from tests.hostile.replica import MODEL, Replica, gateway_config, json_answer, ready

FORGED = {
    "do_remote_prefill": True,
    "remote_host": "10.6.6.6",
    "remote_port": 5600,
    "remote_engine_id": "evil",
    "remote_block_ids": [1, 2, 3],
}
BODY = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 4, "kv_transfer_params": FORGED}
DECODE_ONLY = disagg_picker(
    {
        "type": "disagg-profile-handler",
        "parameters": {"deciders": {"prefill": "never"}},
    },
    [
        {
            "type": "prefix-based-pd-decider",
            "name": "never",
            "parameters": {"nonCachedTokens": 100000},
        }
    ],
)


async def failing_prefill(request: web.Request, raw: bytes) -> web.StreamResponse:
    return web.json_response({"error": {"message": "boom"}}, status=500)


def forged_anywhere(replica: Replica) -> list[Any]:
    return [
        c.body.get("kv_transfer_params")
        for c in replica.calls
        if c.body.get("kv_transfer_params")
        and c.body["kv_transfer_params"].get("remote_host") == "10.6.6.6"
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_plain_pool_strips_client_kv_transfer_params(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    replica = await Replica().start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/completions", json={**BODY, "stream": stream}) as r:
                assert r.status == 200
                await r.read()
        (call,) = replica.calls
        assert "kv_transfer_params" not in call.body
        assert call.body["prompt"] == BODY["prompt"]
    finally:
        await replica.stop()


@pytest.mark.parametrize(
    ("picker", "prefill_answer", "prefill_calls"),
    [
        pytest.param(DECODE_ONLY, json_answer, 0, id="decode-only-decision"),
        pytest.param(disagg_picker(PD_HANDLER), failing_prefill, 1, id="prefill-leg-failed"),
        pytest.param(disagg_picker(PD_HANDLER), json_answer, 1, id="prefill-decode"),
    ],
)
async def test_pd_gateway_mode_never_relays_client_kv_transfer_params(
    http: aiohttp.ClientSession, picker: dict[str, Any], prefill_answer: Any, prefill_calls: int
) -> None:
    prefill, decode = await Replica(prefill_answer).start(), await Replica().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    try:
        cfg = gateway_config([], picker, endpoints, top={"disaggregation": {"mode": "gateway"}})
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            async with http.post(gw.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
        assert len(prefill.calls) == prefill_calls
        (call,) = decode.calls
        assert forged_anywhere(decode) == forged_anywhere(prefill) == []
        if prefill_calls == 0 or prefill_answer is failing_prefill:
            assert "kv_transfer_params" not in call.body
    finally:
        await prefill.stop()
        await decode.stop()


async def test_ext_proc_mode_strips_client_kv_transfer_params() -> None:
    from servegate.extproc.stream import ExtProcStream
    from tests.unit.test_extproc_stream import chat_body, make_gateway, send_request

    stream = ExtProcStream(make_gateway())
    answer = await send_request(stream, chat_body(kv_transfer_params=FORGED))
    forwarded = orjson.loads(answer.body)
    assert "kv_transfer_params" not in forwarded
    assert answer.set_headers["content-length"] == str(len(answer.body))
    stream.close()
