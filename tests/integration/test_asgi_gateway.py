"""GatewayASGI: the gateway's request path run directly by an ASGI host, driven here by
plain ASGI calls (scope, receive, send) against simulated replicas."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from servegate.config import ConfigError
from servegate.integrations.asgi_gateway import GatewayASGI, Message
from servegate.testing.cluster import SimCluster
from tests.unit.fake_replica import wait_until

ADMIN_KEY = "admin-secret"


class Client:
    """One ASGI HTTP exchange: what an ASGI server would feed the app and collect.
    `stall`: the body stops arriving after its first part (more is promised)."""

    def __init__(self, body: bytes, chunks: int = 1, stall: bool = False) -> None:
        step = max(1, -(-len(body) // chunks))
        self.parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        self.stall = stall
        self.sent: list[Message] = []
        self.leave = asyncio.Event()

    async def receive(self) -> Message:
        if self.parts:
            chunk = self.parts.pop(0)
            more = bool(self.parts) or self.stall
            return {"type": "http.request", "body": chunk, "more_body": more}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = orjson.loads(self.body)["error"]
        return error


def scope(
    method: str, path: str, query: bytes = b"", headers: dict[str, str] | None = None
) -> dict[str, Any]:
    raw = [(b"content-type", b"application/json"), (b"host", b"example")]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": raw,
        "client": ("10.1.2.3", 5000),
    }


def chat(stream: bool, max_tokens: int = 4) -> bytes:
    return orjson.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


async def call(app: GatewayASGI, client: Client, *args: Any, **kwargs: Any) -> Client:
    await app(scope(*args, **kwargs), client.receive, client.send)
    return client


def idle(app: GatewayASGI) -> bool:
    gw = app.gateway
    assert gw is not None
    return all(s.in_flight_requests == 0 for s in gw.pool)


@pytest.fixture
async def gateway() -> AsyncIterator[GatewayASGI]:
    async with SimCluster(2) as sims:
        app = GatewayASGI.from_mapping(
            {
                "gateway": {
                    "access_log": False,
                    "max_body_bytes": 64 * 1024,
                    "body_timeout_s": 0.3,
                    "admin_keys": [ADMIN_KEY],
                },
                "pool": {"endpoints": [{"url": url} for url in sims.urls]},
            }
        )
        events = Client(b"")
        lifespan_inbox: asyncio.Queue[Message] = asyncio.Queue()
        await lifespan_inbox.put({"type": "lifespan.startup"})
        task = asyncio.create_task(app({"type": "lifespan"}, lifespan_inbox.get, events.send))
        await wait_until(lambda: bool(events.sent), 10)
        assert events.sent == [{"type": "lifespan.startup.complete"}]
        gw = app.gateway
        assert gw is not None
        await wait_until(lambda: gw.pool.ready_count() == 2, 10)
        assert (await call(app, Client(b""), "GET", "/ready")).status == 200
        yield app
        await lifespan_inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, 30)
        assert events.sent[-1] == {"type": "lifespan.shutdown.complete"}
        assert app.gateway is None


@pytest.mark.parametrize(
    ("stream", "chunks", "content_type"),
    [
        (False, 1, b"application/json"),
        (False, 3, b"application/json"),
        (True, 1, b"text/event-stream"),
    ],
    ids=["json", "json-body-in-chunks", "sse"],
)
async def test_a_completion_is_answered_directly(
    gateway: GatewayASGI, stream: bool, chunks: int, content_type: bytes
) -> None:
    client = await call(gateway, Client(chat(stream), chunks), "POST", "/v1/chat/completions")
    assert client.status == 200
    assert client.headers[b"content-type"].startswith(content_type)
    assert b"x-gateway-destination-endpoint-served" in client.headers
    assert b"transfer-encoding" not in client.headers
    assert client.sent[-1]["more_body"] is False
    assert all(m["more_body"] for m in client.sent[1:-1])
    if stream:
        assert b"content-length" not in client.headers
        assert client.body.rstrip().endswith(b"data: [DONE]")
    else:
        assert int(client.headers[b"content-length"]) == len(client.body)
        assert orjson.loads(client.body)["usage"]["completion_tokens"] == 4
    assert idle(gateway)


@pytest.mark.parametrize(
    ("method", "path", "query", "status", "code"),
    [
        ("GET", "/v1/models", b"", 200, None),
        ("GET", "/v1/models", b"x=1", 200, None),
        ("GET", "/v1/models/sim-model", b"", 200, None),
        ("GET", "/v1/models/nope", b"", 404, "model_not_found"),
        ("GET", "/health", b"", 200, None),
        ("GET", "/metrics", b"", 200, None),
        ("GET", "/openapi.json", b"", 200, None),
        ("GET", "/nowhere", b"", 404, "not_found"),
        ("GET", "/v1/nowhere", b"", 404, "not_found"),
        ("GET", "/v1/chat/completions", b"", 405, None),
        ("POST", "/health", b"", 405, None),
        ("POST", "/v1/chat/completions", b"", 400, None),
        ("GET", "/admin/pool", b"", 401, "invalid_api_key"),
        ("POST", "/admin/endpoints/10.9.9.9:1/drain", b"", 401, "invalid_api_key"),
    ],
    ids=[
        "models",
        "query-string",
        "one-model",
        "unknown-model",
        "health",
        "metrics",
        "openapi",
        "not-found",
        "v1-not-found",
        "wrong-method",
        "wrong-method-probe",
        "bad-body",
        "admin-without-key",
        "drain-without-key",
    ],
)
async def test_the_http_gateways_routes_and_errors(
    gateway: GatewayASGI, method: str, path: str, query: bytes, status: int, code: str | None
) -> None:
    client = await call(gateway, Client(b"{" if method == "POST" else b""), method, path, query)
    assert client.status == status
    if status >= 400:
        assert client.headers[b"content-type"] == b"application/json"
        assert client.error()["code"] == code


async def test_the_admin_routes_answer_with_the_admin_key(gateway: GatewayASGI) -> None:
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    pool = await call(gateway, Client(b""), "GET", "/admin/pool", headers=auth)
    assert pool.status == 200
    assert len(orjson.loads(pool.body)["endpoints"]) == 2
    gw = gateway.gateway
    assert gw is not None
    address = next(iter(gw.pool)).address
    path = f"/admin/endpoints/{address}/drain"
    drained = await call(gateway, Client(b""), "POST", path, headers=auth)
    assert orjson.loads(drained.body) == {"address": address, "draining": True}
    missing = await call(gateway, Client(b""), "POST", "/admin/endpoints/x:1/undrain", headers=auth)
    assert (missing.status, missing.error()["code"]) == (404, "not_found")


async def test_a_client_leaving_mid_stream_cancels_the_request(gateway: GatewayASGI) -> None:
    client = Client(chat(True, max_tokens=2000))
    relay = asyncio.create_task(call(gateway, client, "POST", "/v1/chat/completions"))
    await wait_until(lambda: len(client.sent) >= 3, 10)
    client.leave.set()
    await asyncio.wait_for(relay, 10)
    assert not client.body.rstrip().endswith(b"data: [DONE]")
    assert client.sent[-1]["more_body"] is True  # never ended: the client had gone
    assert idle(gateway)


async def test_a_client_leaving_before_its_body_ends_gets_no_answer(
    gateway: GatewayASGI,
) -> None:
    client = Client(chat(False), stall=True)  # more is promised; the client leaves instead
    client.leave.set()
    await asyncio.wait_for(call(gateway, client, "POST", "/v1/chat/completions"), 10)
    assert client.sent == []
    assert idle(gateway)


@pytest.mark.parametrize(
    ("body", "headers", "chunks"),
    [
        pytest.param(b"{}", {"content-length": str(1024 * 1024)}, 1, id="declared"),
        pytest.param(b" " * (128 * 1024), {}, 8, id="streamed"),
        pytest.param(
            gzip.compress(b'{"pad": "' + b" " * (1024 * 1024) + b'"}'),
            {"content-encoding": "gzip"},
            1,
            id="gzip-bomb",
        ),
    ],
)
async def test_a_body_over_the_limit_is_an_openai_413(
    gateway: GatewayASGI, body: bytes, headers: dict[str, str], chunks: int
) -> None:
    client = Client(body, chunks)
    await call(gateway, client, "POST", "/v1/chat/completions", headers=headers)
    assert (client.status, client.error()["code"]) == (413, "request_too_large")
    assert idle(gateway)


@pytest.mark.parametrize(
    ("encoding", "body", "status"),
    [
        pytest.param("gzip", gzip.compress(chat(False)), 200, id="gzip"),
        pytest.param("deflate", zlib.compress(chat(False)), 200, id="deflate"),
        pytest.param("gzip", gzip.compress(chat(False))[:-12], 400, id="truncated"),
        pytest.param("gzip", chat(False), 400, id="not-gzip-at-all"),
        pytest.param("deflate", zlib.compress(chat(False))[2:-4], 200, id="raw-deflate"),
        pytest.param("zstd", chat(False), 400, id="undecodable"),
        pytest.param("x-unknown", chat(False), 200, id="unknown-is-left-as-it-is"),
    ],
)
async def test_a_compressed_body_is_decoded_or_an_openai_error(
    gateway: GatewayASGI, encoding: str, body: bytes, status: int
) -> None:
    client = Client(body)
    headers = {"content-encoding": encoding}
    await call(gateway, client, "POST", "/v1/chat/completions", headers=headers)
    assert client.status == status
    if status >= 400:
        assert client.error()["type"] == "invalid_request_error"


async def test_a_body_that_stalls_is_an_openai_408(gateway: GatewayASGI) -> None:
    client = Client(chat(False), stall=True)
    await asyncio.wait_for(call(gateway, client, "POST", "/v1/chat/completions"), 10)
    assert (client.status, client.error()["code"]) == (408, "request_timeout")


async def test_websocket_is_refused(gateway: GatewayASGI) -> None:
    client = Client(b"")
    await gateway({"type": "websocket", "path": "/"}, client.receive, client.send)
    assert client.sent == [{"type": "websocket.close", "code": 1003}]


def test_a_bad_config_is_refused_before_serving() -> None:
    with pytest.raises(ConfigError, match="gatway"):
        GatewayASGI.from_mapping({"gatway": {}})
