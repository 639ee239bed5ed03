"""The ext_proc picker end to end: a real gRPC server, a client that speaks Envoy's side of the
protocol, and replicas that answer over HTTP (the test forwards where the picker says, as
Envoy's router would)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servegate.config import parse_config
from servegate.extproc.client import BUFFERED_NO_RESPONSE_BODY, ProxyStream, RequestAnswer
from servegate.extproc.protocol import SERVICE_NAME
from servegate.extproc.server import ExtProcServer
from servegate.gateway.app import build_gateway
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import MODEL, chat, gateway_config, wait_for

CHAT = "/v1/chat/completions"


def extproc_config(urls: list[str], **extra: Any) -> dict[str, Any]:
    cfg = gateway_config(urls, **extra)
    cfg["extproc"] = {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": 0}
    return cfg


def build(cfg: dict[str, Any]) -> ExtProcServer:
    config = parse_config("", "<test>", environ={}, overrides=cfg)
    return ExtProcServer(build_gateway(config, None, io.BytesIO()))


async def ready(server: ExtProcServer, n: int) -> None:
    pool = server.gw.pool
    await wait_for(
        lambda: pool.ready_count() == n and all(s.metrics.scraped_at > 0 for s in pool),
        what=f"{n} ready endpoints",
    )


@pytest.fixture
async def picker(cluster: SimCluster) -> AsyncIterator[ExtProcServer]:
    async with build(extproc_config(cluster.urls)) as server:
        await ready(server, len(cluster))
        yield server


@pytest.fixture
async def channel(picker: ExtProcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as ch:
        yield ch


async def forward(
    session: aiohttp.ClientSession, answer: RequestAnswer, path: str = CHAT
) -> tuple[int, str, list[bytes]]:
    """What Envoy's router does with the picker's answer: send the body to the first endpoint."""
    headers = {k: v for k, v in answer.set_headers.items() if not k.startswith("x-gateway")}
    headers["content-type"] = "application/json"
    url = f"http://{answer.endpoints[0]}{path}"
    async with session.post(url, data=answer.body, headers=headers) as resp:
        parts = [chunk async for chunk in resp.content.iter_any()]
        return resp.status, resp.content_type, parts


async def test_health_and_metrics_ports(
    picker: ExtProcServer, session: aiohttp.ClientSession
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", SERVICE_NAME):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as resp:
        text = await resp.text()
    assert 'inference_pool_ready_pods{name="default"} 3.0' in text


async def test_non_streaming_request_round_trip(
    picker: ExtProcServer,
    channel: grpc.aio.Channel,
    cluster: SimCluster,
    session: aiohttp.ClientSession,
) -> None:
    stream = ProxyStream(channel)
    body = orjson.dumps(chat())
    answer = await stream.request(CHAT, body, headers=[("x-request-id", "r-1")], chunk_size=10)
    assert answer.kinds[:1] == ["request_headers"]
    assert set(answer.kinds[1:]) == {"request_body"}
    assert answer.destination == answer.metadata_destination
    assert set(answer.endpoints) == set(cluster.addresses)
    assert answer.body == body
    status, content_type, parts = await forward(session, answer)
    assert (status, content_type) == (200, "application/json")
    mutation, returned = await stream.respond(status, parts, served=answer.endpoints[0])
    await stream.close()
    assert returned == b"".join(parts)
    assert mutation["x-gateway-destination-endpoint"] == answer.endpoints[0]
    assert mutation["x-request-id"] == "r-1"
    registry = picker.gw.metrics.registry
    labels = {"model_name": MODEL, "target_model_name": MODEL}
    counted = {**labels, "priority": "0"}
    await wait_for(
        lambda: registry.get_sample_value("inference_objective_request_total", counted) == 1.0,
        what="the request counted",
    )
    assert registry.get_sample_value("inference_objective_output_tokens_sum", labels) == 8.0
    assert all(s.in_flight_requests == 0 for s in picker.gw.pool)


async def test_streaming_request_round_trip_with_trailers(
    picker: ExtProcServer, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    stream = ProxyStream(channel)
    body = orjson.dumps(chat(stream=True, stream_options={"include_usage": True}, max_tokens=5))
    answer = await stream.request(CHAT, body)
    status, content_type, parts = await forward(session, answer)
    assert (status, content_type) == (200, "text/event-stream")
    _, returned = await stream.respond(
        status, parts, served=answer.endpoints[0], content_type=content_type,
        trailers=[("x-envoy-upstream-service-time", "1")],
    )  # fmt: skip
    await stream.close()
    assert returned == b"".join(parts)
    assert returned.rstrip().endswith(b"data: [DONE]")
    labels = {"model_name": MODEL, "target_model_name": MODEL}
    registry = picker.gw.metrics.registry
    await wait_for(
        lambda: registry.get_sample_value("inference_objective_output_tokens_sum", labels) == 5.0,
        what="usage read from the stream",
    )


async def test_subset_hint_and_rejections_over_grpc(
    picker: ExtProcServer, channel: grpc.aio.Channel, cluster: SimCluster
) -> None:
    only = cluster.addresses[1]
    held = ProxyStream(channel)
    answer = await held.request(CHAT, orjson.dumps(chat()), subset=[only])
    assert answer.endpoints == [only]
    await held.close()
    rejected = await ProxyStream(channel).request(CHAT, orjson.dumps(chat()), subset=[])
    assert rejected.immediate_status == 503
    assert rejected.immediate_headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    unknown = await ProxyStream(channel).request(CHAT, orjson.dumps(chat(model="nope")))
    assert unknown.immediate_status == 404
    await wait_for(
        lambda: all(s.in_flight_requests == 0 for s in picker.gw.pool), what="streams released"
    )


async def test_a_cancelled_stream_releases_its_endpoint(
    picker: ExtProcServer, channel: grpc.aio.Channel
) -> None:
    stream = ProxyStream(channel)
    answer = await stream.request(CHAT, orjson.dumps(chat()))
    state = picker.gw.pool.get(answer.endpoints[0])
    assert state is not None
    assert state.in_flight_requests == 1
    stream.cancel()
    await wait_for(lambda: state.in_flight_requests == 0, what="the endpoint released")


async def test_buffered_mode_round_trip_over_grpc(
    picker: ExtProcServer,
    channel: grpc.aio.Channel,
    cluster: SimCluster,
    session: aiohttp.ClientSession,
) -> None:
    """deploy/extproc/envoy-buffered.yaml's modes: BUFFERED request body, response body NONE."""
    stream = ProxyStream(channel, BUFFERED_NO_RESPONSE_BODY)
    body = orjson.dumps(chat(stream=True, max_tokens=5))
    answer = await stream.request(CHAT, body, headers=[("x-request-id", "r-b")])
    assert answer.kinds == ["request_headers", "request_body"]
    assert answer.destination == answer.metadata_destination
    assert set(answer.endpoints) == set(cluster.addresses)
    assert answer.clear_route_cache
    assert answer.body == body  # not rewritten: the proxy keeps its own
    assert answer.set_headers["x-request-id"] == "r-b"
    state = picker.gw.pool.get(answer.endpoints[0])
    assert state is not None
    assert state.in_flight_requests == 1
    status, content_type, parts = await forward(session, answer)
    assert (status, content_type) == (200, "text/event-stream")
    mutation, returned = await stream.respond(
        status, parts, served=answer.endpoints[0], content_type=content_type
    )
    await stream.close()
    assert returned.rstrip().endswith(b"data: [DONE]")
    assert mutation["x-gateway-destination-endpoint"] == answer.endpoints[0]
    assert mutation["x-request-id"] == "r-b"
    registry = picker.gw.metrics.registry
    counted = {"model_name": MODEL, "target_model_name": MODEL, "priority": "0"}
    await wait_for(
        lambda: registry.get_sample_value("inference_objective_request_total", counted) == 1.0,
        what="the request counted",
    )
    # no response body in this mode: released at the response headers, no usage read
    assert state.in_flight_requests == 0
    labels = {"model_name": MODEL, "target_model_name": MODEL}
    assert registry.get_sample_value("inference_objective_output_tokens_sum", labels) == 0.0


@pytest.mark.parametrize(
    ("body", "subset", "status", "error_type"),
    [
        pytest.param(b"{not json", None, 400, "invalid_request_error", id="bad-json"),
        pytest.param(orjson.dumps(chat(model="nope")), None, 404, "invalid_request_error",
                     id="unknown-model"),
        pytest.param(orjson.dumps(chat()), [], 503, "service_unavailable_error", id="empty-subset"),
    ],
)  # fmt: skip
async def test_buffered_mode_rejections_are_immediate_responses_with_openai_errors(
    picker: ExtProcServer,
    channel: grpc.aio.Channel,
    body: bytes,
    subset: list[str] | None,
    status: int,
    error_type: str,
) -> None:
    stream = ProxyStream(channel, BUFFERED_NO_RESPONSE_BODY)
    answer = await stream.request(CHAT, body, headers=[("x-request-id", "r-e")], subset=subset)
    await stream.close()
    assert answer.kinds == ["request_headers", "immediate_response"]
    assert answer.immediate_status == status
    assert answer.immediate_headers["content-type"] == "application/json"
    assert answer.immediate_headers["x-request-id"] == "r-e"
    error = orjson.loads(answer.immediate_body)["error"]
    assert error["type"] == error_type
    assert error["message"]
    assert all(s.in_flight_requests == 0 for s in picker.gw.pool)


async def test_empty_pool_answers_503() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = extproc_config([dead])
    cfg["pool"]["endpoints"] = [{"url": dead, "model": MODEL}]
    async with (
        build(cfg) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch,
    ):
        answer = await ProxyStream(ch).request(CHAT, orjson.dumps(chat()))
    assert answer.immediate_status == 503
    assert answer.immediate_headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


# -- the same decisions as the HTTP gateway -------------------------------------------------

VLLM_PAGE = """\
vllm:num_requests_running{{model_name="{model}"}} 0.0
vllm:num_requests_waiting{{model_name="{model}"}} {waiting}
vllm:kv_cache_usage_perc{{model_name="{model}"}} {kv}
"""


class StaticReplica:
    """A replica whose metrics never change, so two routers scraping it see the same state."""

    def __init__(self, waiting: float, kv: float) -> None:
        self.page = VLLM_PAGE.format(model=MODEL, waiting=waiting, kv=kv)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> StaticReplica:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(CHAT, self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.page)

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "chat.completion", "choices": []})


AGREEMENT_PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "prefix-cache-scorer", "parameters": {"blockSizeTokens": 4}},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
}
PROMPTS = ["alpha " * 20, "beta " * 20, "alpha " * 20 + "more", "gamma " * 5] * 3


async def test_decisions_agree_with_the_http_gateway(session: aiohttp.ClientSession) -> None:
    replicas = [await StaticReplica(w, kv).start() for w, kv in [(0, 0.1), (0, 0.1), (2, 0.3)]]
    urls = [r.url for r in replicas]
    cfg = extproc_config(urls, picker=AGREEMENT_PICKER, debug_headers=True)
    try:
        async with (
            GatewayRunner(cfg) as http_gateway,
            build(cfg) as server,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch,
        ):
            for pool in (http_gateway.gateway.pool, server.gw.pool):
                await wait_for(
                    lambda p=pool: (
                        p.ready_count() == 3  # type: ignore[misc]
                        and all(s.metrics.scraped_at > 0 for s in p)
                    ),
                    what="both routers see three replicas",
                )
            http_choices, extproc_choices = [], []
            for prompt in PROMPTS:
                body = chat(prompt)
                async with session.post(http_gateway.url + CHAT, json=body) as resp:
                    assert resp.status == 200
                    ranked = orjson.loads(resp.headers["x-servegate-scores"])["ranked"]
                    assert resp.headers["x-gateway-destination-endpoint"] == ranked[0]
                http_choices.append(ranked[:3])
                stream = ProxyStream(ch)
                answer = await stream.request(CHAT, orjson.dumps(body))
                await stream.respond(200, [b"{}"], served=answer.endpoints[0])
                await stream.close()
                extproc_choices.append(answer.endpoints)
    finally:
        for replica in replicas:
            await replica.stop()
    assert extproc_choices == http_choices
    assert len({tuple(c) for c in http_choices}) > 1, "ties and prefixes should vary the picks"
    # the prefix index matters: the same prompt goes back where it went (replica 3 is loaded)
    assert len({tuple(c[:1]) for c in http_choices[0::4]}) == 1


# -- the command -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_servegate_extproc_command_serves_health_and_stops_on_sigterm(
    cluster: SimCluster,
) -> None:
    port, health, metrics = _free_port(), _free_port(), _free_port()
    args = [
        "-m", "servegate.cli", "extproc", "--host", "127.0.0.1", "--endpoint", cluster.urls[0],
        "--port", str(port), "--health-port", str(health), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = {**os.environ, "SERVEGATE_GATEWAY__ACCESS_LOG": "false"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service="readiness"), wait_for_ready=True, timeout=20
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
        assert proc.stderr is not None
        stderr = (await proc.stderr.read()).decode()
        assert code == 0, stderr
        assert "ext_proc picker listening" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_passthrough_paths_are_scheduled_by_model_and_rewritten_by_header(
    picker: ExtProcServer, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    """`/v1/messages`, `/tokenize` and any other `/v1/…` body are routed by their model, as in
    HTTP mode; llm-d's model-name-rewrite header names a model no pool serves → 404."""
    registry = picker.gw.metrics.registry
    anthropic = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/messages", anthropic),
        ("/tokenize", {"model": MODEL, "prompt": "hello"}),
        ("/v1/some/new/route", {"model": MODEL}),
    ):
        stream = ProxyStream(channel)
        answer = await stream.request(path, orjson.dumps(body))
        assert answer.immediate_status is None, answer.immediate_body
        status, _, parts = await forward(session, answer, path)
        mutation, _ = await stream.respond(status, parts, served=answer.endpoints[0])
        await stream.close()
        assert mutation["x-gateway-destination-endpoint-served"] == answer.endpoints[0]
    labels = {
        "model_name": MODEL,
        "target_model_name": MODEL,
        "fairness_id": "default-flow",
        "priority": "0",
    }
    await wait_for(
        lambda: registry.get_sample_value("llm_d_epp_request_total", labels) == 3.0,
        what="three routed requests",
    )
    stream = ProxyStream(channel)
    answer = await stream.request(
        "/v1/messages", orjson.dumps(anthropic), headers=[("x-llm-d-model-name-rewrite", "gone")]
    )
    await stream.close()
    assert answer.immediate_status == 404
    assert b"routed to `gone`" in answer.immediate_body
