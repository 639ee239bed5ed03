"""The gateway's side of P/D and data parallelism (gateway/disagg.py), against recording upstreams."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from tests.disagg_pickers import PD_HANDLER, disagg_picker

from servegate.config import DisaggregationSettings, parse_config
from servegate.gateway.disagg import (
    REMOTE_DECODE_PARAMS,
    data_parallel_route,
    decode_request,
    prefill_request,
    resolve_mode,
    sidecar_headers,
)
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.config import load_picker_config
from servegate.scheduling.disagg import DisaggHeadersHandler, PrefixBasedPDDecider
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import Decision, Plugin
from servegate.testing.endpoints import endpoint_state
from servegate.testing.gateway import GatewayRunner

MODEL = "m"
METRICS = "".join(
    f'vllm:{name}{{engine="0",model_name="{MODEL}"}} 0.0\n'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
)
PARAMS_FROM_PREFILL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5],
    "remote_engine_id": "m@127.0.0.1:1",
    "remote_request_id": "cmpl-1",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "tp_size": 1,
}


# -- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected_extra"),
    [
        pytest.param(
            {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True,
             "stream_options": {"include_usage": True}},
            {}, id="streamed-completion",
        ),
        pytest.param(
            {"model": MODEL, "messages": [], "max_completion_tokens": 50, "min_tokens": 10},
            {"max_completion_tokens": 1, "min_tokens": 1}, id="chat-with-completion-and-min-tokens",
        ),
    ],
)  # fmt: skip
def test_prefill_request(body: dict[str, Any], expected_extra: dict[str, Any]) -> None:
    original = dict(body)
    out = prefill_request(body)
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert (out["stream"], out["max_tokens"], "stream_options" in out) == (False, 1, False)
    for key, value in expected_extra.items():
        assert out[key] == value
    assert body == original
    assert out["kv_transfer_params"] is not REMOTE_DECODE_PARAMS


def test_decode_request_adds_the_prefill_parameters_and_nothing_else() -> None:
    body = {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 9}
    assert decode_request(body, PARAMS_FROM_PREFILL) == {
        **body,
        "kv_transfer_params": PARAMS_FROM_PREFILL,
    }


HEADERS_PLUGIN = DisaggHeadersHandler("disagg-headers-handler")
DECIDER = PrefixBasedPDDecider()


@pytest.mark.parametrize(
    ("mode", "plugins", "expected"),
    [
        # llm-d's disagg-profile-handler writes x-prefiller-host-port itself: auto is the sidecar
        pytest.param("auto", {}, "sidecar", id="auto-plain"),
        pytest.param("auto", {"h": HEADERS_PLUGIN, "d": DECIDER}, "sidecar", id="auto-llm-d-header-plugin"),
        pytest.param("gateway", {"h": HEADERS_PLUGIN}, "gateway", id="explicit-gateway-wins"),
        pytest.param("sidecar", {}, "sidecar", id="explicit-sidecar"),
    ],
)  # fmt: skip
def test_resolve_mode(mode: Any, plugins: dict[str, Plugin], expected: str) -> None:
    assert resolve_mode(DisaggregationSettings(mode=mode), plugins) == expected


@pytest.mark.parametrize(
    ("address", "url", "expected_base"),
    [
        pytest.param("10.0.0.1:8201", "http://10.0.0.1:8201", "http://10.0.0.1:8000", id="ipv4"),
        pytest.param("[fd00::1]:8201", "http://[fd00::1]:8201", "http://[fd00::1]:8000", id="ipv6"),
        pytest.param("h:8201", "https://h:8201/prefix", "https://h:8000/prefix", id="path-kept"),
    ],
)
def test_data_parallel_route(address: str, url: str, expected_base: str) -> None:
    state = EndpointState(Endpoint(address=address, url=url))
    base, headers = data_parallel_route(8000)(state, {"X-Request-ID": "r"})
    assert base == expected_base
    assert headers == {"X-Request-ID": "r", "x-data-parallel-host-port": address}


def test_sidecar_headers() -> None:
    decode, prefill = endpoint_state("10.0.0.2:8200"), endpoint_state("10.0.0.1:8000")
    assert sidecar_headers(Decision(decode, [])) == {}
    assert sidecar_headers(Decision(decode, [], prefill=prefill, primary_port=8000)) == {
        "x-prefiller-host-port": "10.0.0.1:8000",
        "x-data-parallel-host-port": "10.0.0.2:8200",
    }


# -- against recording upstreams ----------------------------------------------------------


@dataclass
class Call:
    headers: dict[str, str]
    body: dict[str, Any]


class Upstream:
    """A vLLM stand-in that records every inference request; `prefill` says how it answers one."""

    def __init__(self, prefill: str = "ok") -> None:
        self.prefill = prefill
        self.calls: list[Call] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Upstream:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.calls.append(Call({k.lower(): v for k, v in request.headers.items()}, body))
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return await self._prefill_answer(request)
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for text in ("a", "b"):
                chunk = {"choices": [{"index": 0, "text": text}]}
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        answer = {"choices": [{"index": 0, "text": "ab"}], "kv_transfer_params": None}
        return web.json_response(answer)

    async def _prefill_answer(self, request: web.Request) -> web.StreamResponse:
        if self.prefill == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.prefill == "garbage":
            return web.Response(text="not json")
        if self.prefill == "no-params":
            return web.json_response({"choices": [], "kv_transfer_params": None})
        if self.prefill == "hang":
            await asyncio.sleep(30)
        if self.prefill == "close":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
        return web.json_response({"choices": [], "kv_transfer_params": PARAMS_FROM_PREFILL})


def config(
    endpoints: list[dict[str, Any]], picker: dict[str, Any], **disaggregation: Any
) -> dict[str, Any]:
    return {
        "gateway": {"seed": 1, "port": 0},
        "disaggregation": disaggregation,
        "outlier_detection": {"enabled": False},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5},
            "endpoints": endpoints,
        },
        "picker": picker,
    }


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5.0
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def ready(gw: GatewayRunner, n: int) -> None:
    pool = gw.gateway.pool
    await wait_until(
        lambda: pool.ready_count() == n and pool.resolve_model(MODEL) is not None, "ready pool"
    )


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, gw: GatewayRunner, body: dict[str, Any], **headers: str
) -> tuple[int, bytes]:
    async with http.post(
        gw.url + "/v1/completions", json=body, headers={"X-Request-ID": "req-1", **headers}
    ) as resp:
        return resp.status, await resp.read()


def metric(gw: GatewayRunner, name: str, labels: dict[str, str]) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


BODY = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 9}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_gateway_mode_runs_both_legs(http: aiohttp.ClientSession, stream: bool) -> None:
    prefill, decode = await Upstream().start(), await Upstream().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    body = {**BODY, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        cfg = config(endpoints, disagg_picker(PD_HANDLER), mode="gateway")
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            status, answer = await post(http, gw, body)
            assert status == 200
            assert (b"data: [DONE]" in answer) is stream
            assert [c.body for c in prefill.calls] == [prefill_request(body)]
            assert [c.body for c in decode.calls] == [decode_request(body, PARAMS_FROM_PREFILL)]
            for call in (*prefill.calls, *decode.calls):
                assert call.headers["x-request-id"] == "req-1"
                assert "x-prefiller-host-port" not in call.headers
            (line,) = gw.access_lines()
            assert line["endpoint"] == decode.address
            assert (line["pd_decision"], line["prefill_endpoint"]) == (
                "prefill-decode",
                prefill.address,
            )
            assert (line["prefill_status"], line["prefill_error"]) == (200, None)
            assert line["prefill_ms"] > 0
            decided = {"model_name": MODEL, "decision_type": "prefill-decode"}
            assert metric(gw, "llm_d_inference_scheduler_disagg_decision_total", decided) == 1
            assert metric(gw, "llm_d_epp_disagg_decision_total", decided) == 1
            assert metric(gw, "llm_d_epp_pd_decision_total", decided) == 1
            assert all(s.in_flight_requests == 0 for s in gw.gateway.pool)
            assert all(s.in_flight_tokens == 0 for s in gw.gateway.pool)
    finally:
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize(
    ("behaviour", "reason", "message"),
    [
        pytest.param("500", "status", "answered 500", id="error-status"),
        pytest.param("garbage", "bad-response", "not JSON", id="not-json"),
        pytest.param("no-params", "bad-response", "no kv_transfer_params", id="no-params"),
        pytest.param("hang", "timeout", "no answer in 0.3 s", id="timeout"),
        pytest.param("close", "connect", "failed", id="connection-dropped"),
    ],
)
async def test_prefill_failure_falls_back_to_decode_only(
    http: aiohttp.ClientSession, behaviour: str, reason: str, message: str
) -> None:
    prefill, decode = await Upstream(prefill=behaviour).start(), await Upstream().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    try:
        cfg = config(endpoints, disagg_picker(PD_HANDLER), mode="gateway", prefill_timeout_s=0.3)
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            status, answer = await post(http, gw, BODY)
            assert status == 200, answer
            assert len(prefill.calls) == 1
            assert [c.body for c in decode.calls] == [BODY]
            (line,) = gw.access_lines()
            assert (line["status"], line["endpoint"], line["pd_decision"]) == (
                200,
                decode.address,
                "prefill-decode",
            )
            assert message in line["prefill_error"]
            fallbacks = "servegate_disagg_prefill_fallbacks_total"
            assert metric(gw, fallbacks, {"reason": reason}) == 1
            assert gw.gateway.pool.get(prefill.address).in_flight_requests == 0  # type: ignore[union-attr]
    finally:
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        pytest.param("sidecar", [], id="explicit"),
        pytest.param("auto", [{"type": "prefill-header-handler"}], id="auto-with-llm-d-plugin"),
    ],
)
async def test_sidecar_mode_sets_the_header_and_nothing_else(
    http: aiohttp.ClientSession, mode: str, extra: list[dict[str, Any]]
) -> None:
    prefill, decode = await Upstream().start(), await Upstream().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    try:
        async with GatewayRunner(
            config(endpoints, disagg_picker(PD_HANDLER, extra), mode=mode)
        ) as gw:
            await ready(gw, 2)
            status, _ = await post(http, gw, BODY, **{"x-prefiller-host-port": "6.6.6.6:1"})
            assert status == 200
            assert prefill.calls == []
            (call,) = decode.calls
            assert call.body == BODY
            assert call.headers["x-prefiller-host-port"] == prefill.address
            assert "x-data-parallel-host-port" not in call.headers
            (line,) = gw.access_lines()
            assert (line["prefill_endpoint"], line["prefill_status"]) == (prefill.address, None)
    finally:
        await prefill.stop()
        await decode.stop()


async def test_data_parallel_goes_to_the_sidecar_port_naming_the_rank(
    http: aiohttp.ClientSession,
) -> None:
    ranks = [await Upstream().start(), await Upstream().start()]
    sidecar = await Upstream().start()
    picker = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "data-parallel-profile-handler", "parameters": {"primaryPort": sidecar.port}},
            {"type": "round-robin-picker"},
        ],
    }
    try:
        async with GatewayRunner(config([{"url": r.url} for r in ranks], picker)) as gw:
            await ready(gw, 2)
            for _ in range(2):
                status, _ = await post(http, gw, BODY)
                assert status == 200
            assert [r.calls for r in ranks] == [[], []]
            chosen = [c.headers["x-data-parallel-host-port"] for c in sidecar.calls]
            assert sorted(chosen) == sorted(r.address for r in ranks)
            assert [c.body for c in sidecar.calls] == [BODY, BODY]
            assert [line["endpoint"] for line in gw.access_lines()] == chosen
    finally:
        for upstream in (*ranks, sidecar):
            await upstream.stop()


# -- the examples in docs/disaggregation.md ------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "disaggregation.md"
EXAMPLES = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda text: text.split("\n")[0])
def test_docs_examples_load(example: str) -> None:
    if "kind: EndpointPickerConfig" in example:
        load_picker_config(example, PluginContext())
    else:
        config = parse_config(example, "disaggregation.md", environ={})
        assert config.pool.endpoints


def test_docs_have_both_kinds_of_example() -> None:
    assert sum("kind: EndpointPickerConfig" in e for e in EXAMPLES) == 3
    assert sum("pool:" in e for e in EXAMPLES) == 2


def test_data_parallel_ranks_of_one_pod_are_separate_endpoints() -> None:
    (example,) = [e for e in EXAMPLES if "data-parallel ranks" in e]
    config = parse_config(example, "disaggregation.md", environ={})
    endpoints = [e.to_endpoint("default") for e in config.pool.endpoints]
    # one host, four ports: four endpoints
    assert {e.host for e in endpoints} == {"10.0.0.5"}
    assert [e.address for e in endpoints] == [f"10.0.0.5:{p}" for p in (8200, 8201, 8202, 8203)]


async def test_stock_llmd_pd_config_uses_the_sidecar_protocol(http: aiohttp.ClientSession) -> None:
    """llm-d's disagg-profile-handler alone (no headers handler, no `disaggregation:`):
    one request to the decode replica naming the prefill replica, as llm-d's sidecar expects;
    client-sent routing headers never reach a replica."""
    prefill, decode = await Upstream().start(), await Upstream().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    try:
        async with GatewayRunner(config(endpoints, disagg_picker(PD_HANDLER))) as gw:
            await ready(gw, 2)
            forged = {
                "x-prefiller-host-port": "10.9.9.9:1",
                "x-encoder-hosts-ports": "10.9.9.9:2",
                "x-kv-cache-source-host-port": "10.9.9.9:3",
            }
            status, _ = await post(http, gw, BODY, **forged)
            assert status == 200
            assert prefill.calls == []
            (call,) = decode.calls
            assert call.body == BODY
            assert call.headers["x-prefiller-host-port"] == prefill.address
            assert "x-encoder-hosts-ports" not in call.headers
            assert "x-kv-cache-source-host-port" not in call.headers
    finally:
        await prefill.stop()
        await decode.stop()
