from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from servegate.bench.client import send_request
from servegate.bench.engine_counters import parse_engine_counters
from servegate.bench.workloads import BenchRequest, ChatMessage
from servegate.testing.fastbackend import FastBackendConfig, start_fast_backend

CONFIG = FastBackendConfig(model="fast", chunks=5)


@pytest.fixture
async def backend_url() -> AsyncIterator[str]:
    runner, port = await start_fast_backend(CONFIG, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


CHAT = BenchRequest("fast", 5, messages=(ChatMessage("user", "hi"),))
COMPLETION = BenchRequest("fast", 5, prompt="hi")


@pytest.mark.parametrize("request_", [CHAT, COMPLETION], ids=["chat", "completion"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_answers_with_canned_usage(
    session: aiohttp.ClientSession, backend_url: str, request_: BenchRequest, stream: bool
) -> None:
    result = await send_request(session, backend_url, request_, stream=stream)
    assert result.ok
    assert result.output_tokens == 5
    assert result.prompt_tokens == CONFIG.prompt_tokens
    assert result.cached_tokens == 0
    if stream:
        assert len(result.itl_s) == 4  # 5 output chunks, 4 gaps


async def test_stream_has_chunks_then_usage_then_done(
    session: aiohttp.ClientSession, backend_url: str
) -> None:
    body = {
        "model": "fast",
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(backend_url + "/v1/completions", data=orjson.dumps(body)) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in (await response.read()).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    payloads = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [p["choices"][0]["text"] for p in payloads[:5]] == ["tok "] * 5
    assert payloads[4]["choices"][0]["finish_reason"] == "length"
    assert payloads[5]["choices"] == []
    assert payloads[5]["usage"]["completion_tokens"] == 5


async def test_stream_without_usage_option_has_no_usage_event(
    session: aiohttp.ClientSession, backend_url: str
) -> None:
    body = {"model": "fast", "prompt": "x", "stream": True}
    async with session.post(backend_url + "/v1/completions", data=orjson.dumps(body)) as response:
        events = [e for e in (await response.read()).split(b"\n\n") if e]
    assert len(events) == 6  # 5 chunks + [DONE]


@pytest.mark.parametrize("payload", [b"{not json", b"[1]"], ids=["bad-json", "not-object"])
async def test_bad_body_is_a_400_openai_error(
    session: aiohttp.ClientSession, backend_url: str, payload: bytes
) -> None:
    async with session.post(backend_url + "/v1/chat/completions", data=payload) as response:
        assert response.status == 400
        assert "message" in (await response.json())["error"]


async def test_models_health_and_metrics(session: aiohttp.ClientSession, backend_url: str) -> None:
    async with session.get(backend_url + "/health") as response:
        assert response.status == 200
    async with session.get(backend_url + "/v1/models") as response:
        models = await response.json()
    assert [m["id"] for m in models["data"]] == ["fast"]
    assert models["data"][0]["max_model_len"] == CONFIG.max_model_len
    for _ in range(3):
        await send_request(session, backend_url, CHAT, stream=False)
    async with session.get(backend_url + "/metrics") as response:
        page = await response.text()
    assert "vllm:num_requests_waiting" in page
    assert "vllm:kv_cache_usage_perc" in page
    counters = parse_engine_counters(page)
    assert (counters.requests, counters.prefix_hits, counters.prefix_queries) == (3.0, 0.0, 0.0)
