"""GatewayASGI: the gateway behind an ASGI host, driven here by plain ASGI calls."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from servegate.config import ConfigError
from servegate.integrations.asgi_gateway import GatewayASGI, Message
from servegate.testing.cluster import SimCluster
from tests.unit.fake_replica import wait_until


class Client:
    """One ASGI HTTP exchange: what an ASGI server would feed the app and collect."""

    def __init__(self, body: bytes, chunks: int = 1) -> None:
        step = max(1, -(-len(body) // chunks))
        self.parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        self.sent: list[Message] = []
        self.leave = asyncio.Event()

    async def receive(self) -> Message:
        if self.parts:
            chunk = self.parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.parts)}
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


def scope(method: str, path: str, query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": [(b"content-type", b"application/json"), (b"host", b"example")],
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


@pytest.fixture
async def gateway() -> Any:
    async with SimCluster(2) as sims:
        app = GatewayASGI.from_mapping(
            {
                "gateway": {"access_log": False},
                "pool": {"endpoints": [{"url": url} for url in sims.urls]},
            }
        )
        events = Client(b"")
        lifespan_inbox: asyncio.Queue[Message] = asyncio.Queue()
        await lifespan_inbox.put({"type": "lifespan.startup"})
        task = asyncio.create_task(app({"type": "lifespan"}, lifespan_inbox.get, events.send))
        await wait_until(lambda: bool(events.sent), 10)
        assert events.sent == [{"type": "lifespan.startup.complete"}]
        async with asyncio.timeout(10):
            while True:
                probe = Client(b"")
                await app(scope("GET", "/ready"), probe.receive, probe.send)
                if probe.status == 200:
                    break
                await asyncio.sleep(0.05)
        yield app
        await lifespan_inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, 30)
        assert events.sent[-1] == {"type": "lifespan.shutdown.complete"}
        assert app.url is None


@pytest.mark.parametrize(
    ("stream", "chunks", "content_type"),
    [
        (False, 1, b"application/json"),
        (False, 3, b"application/json"),
        (True, 1, b"text/event-stream"),
    ],
    ids=["json", "json-body-in-chunks", "sse"],
)
async def test_completion_through_the_relay(
    gateway: GatewayASGI, stream: bool, chunks: int, content_type: bytes
) -> None:
    client = Client(chat(stream), chunks)
    await gateway(scope("POST", "/v1/chat/completions"), client.receive, client.send)
    assert client.status == 200
    assert client.headers[b"content-type"].startswith(content_type)
    assert b"transfer-encoding" not in client.headers
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    if stream:
        assert client.body.rstrip().endswith(b"data: [DONE]")
    else:
        assert orjson.loads(client.body)["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("method", "path", "query", "status"),
    [
        ("GET", "/v1/models", b"", 200),
        ("GET", "/v1/models", b"x=1", 200),
        ("GET", "/nowhere", b"", 404),
        ("POST", "/v1/chat/completions", b"", 400),
    ],
    ids=["models", "query-string", "not-found", "bad-body"],
)
async def test_gateway_answers_pass_through(
    gateway: GatewayASGI, method: str, path: str, query: bytes, status: int
) -> None:
    client = Client(b"{" if method == "POST" else b"")
    await gateway(scope(method, path, query), client.receive, client.send)
    assert client.status == status


async def test_client_leaving_mid_stream_ends_the_relay(gateway: GatewayASGI) -> None:
    client = Client(chat(True, max_tokens=2000))
    relay = asyncio.create_task(
        gateway(scope("POST", "/v1/chat/completions"), client.receive, client.send)
    )
    await wait_until(lambda: len(client.sent) >= 3, 10)
    client.leave.set()
    await asyncio.wait_for(relay, 10)
    assert not client.body.rstrip().endswith(b"data: [DONE]")


async def test_websocket_is_refused(gateway: GatewayASGI) -> None:
    client = Client(b"")
    await gateway({"type": "websocket", "path": "/"}, client.receive, client.send)
    assert client.sent == [{"type": "websocket.close", "code": 1003}]


def test_a_bad_config_is_refused_before_serving() -> None:
    with pytest.raises(ConfigError, match="gatway"):
        GatewayASGI.from_mapping({"gatway": {}})
