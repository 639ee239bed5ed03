"""The simulator's OpenAI API over real HTTP: bodies, streams, errors, models, LoRA, tokenize."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.simulator.tokenizer import encode, encode_chat
from servegate.testing.cluster import SimCluster, SimHandle

BASE: dict[str, Any] = {
    "model": "tiny",
    "num_blocks": 65,
    "block_size": 4,
    "max_model_len": 256,
    "speed": 50.0,
    "lora": {"adapters": ["a1=/lora/a1"], "max_loras": 2, "load_latency_s": 0.0},
}


@pytest.fixture
async def sim() -> AsyncIterator[SimHandle]:
    async with SimCluster(1, base=BASE) as cluster:
        yield cluster[0]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


async def test_completion_body(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    body = {"model": "tiny", "prompt": "the model and the cache", "max_tokens": 4}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        data = await resp.json()
    assert data["id"].startswith("cmpl-")
    assert (data["object"], data["model"]) == ("text_completion", "tiny")
    assert isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert len(choice["text"].split()) == 4
    prompt_tokens = len(encode("the model and the cache"))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 4,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_stream_with_usage(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "explain the cache " * 5}]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:-1]]
    # 3 tokens: 3 content chunks, the last one carrying finish_reason
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert all("usage" not in c for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_tokens = len(encode_chat(messages))
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 3,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_stream_without_usage(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        events = sse_events(await resp.text())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(
        set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        for c in chunks
    )


async def test_repeated_prompt_reports_cached_tokens(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    prompt = "please summarize the following document " * 4
    n = len(encode(prompt))
    cached = []
    for _ in range(2):
        async with http.post(
            sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
        ) as resp:
            cached.append((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    # the second request reuses every full block but the one holding the last token
    assert cached == [0, (n - 1) // 4 * 4]


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param"),
    [
        pytest.param(
            {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model", id="unknown-model"
        ),
        pytest.param(
            {"prompt": "x " * 300}, 400, "BadRequestError", "input_tokens", id="prompt-too-long"
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": 1000},
            400,
            "BadRequestError",
            "max_tokens",
            id="max-tokens",
        ),
        pytest.param({"prompt": "x", "n": 2}, 400, "BadRequestError", "n", id="n-above-1"),
        pytest.param({"prompt": ["a", "b"]}, 400, "BadRequestError", "prompt", id="batch-prompt"),
        pytest.param({"prompt": "x", "stop": 5}, 400, "BadRequestError", "stop", id="bad-stop"),
    ],
)
async def test_vllm_error_bodies(
    sim: SimHandle,
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    status: int,
    err_type: str,
    param: str,
) -> None:
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == status
        data = await resp.json()
    assert set(data) == {"error"}
    assert (data["error"]["type"], data["error"]["code"], data["error"]["param"]) == (
        err_type,
        status,
        param,
    )
    assert data["error"]["message"]


async def test_invalid_json_is_400(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"


async def test_models_lists_base_and_adapters(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    base, adapter = data["data"]
    assert (base["id"], base["parent"], base["max_model_len"], base["owned_by"]) == (
        "tiny",
        None,
        256,
        "vllm",
    )
    assert (adapter["id"], adapter["parent"], adapter["root"]) == ("a1", "tiny", "/lora/a1")


async def test_load_and_unload_lora(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    url = sim.url
    async with http.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/p"}
    ) as resp:
        assert resp.status == 200
        assert await resp.text() == "Success: LoRA adapter 'a2' added successfully."
    async with http.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/p"}
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "InvalidUserInput"
    async with http.post(
        url + "/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 1}
    ) as resp:
        assert (resp.status, (await resp.json())["model"]) == (200, "a2")
    async with http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}) as resp:
        assert resp.status == 200
    async with http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}) as resp:
        assert resp.status == 404
    async with http.post(url + "/v1/completions", json={"model": "a2", "prompt": "hi"}) as resp:
        assert resp.status == 404


async def test_tokenize_matches_the_shared_tokenizer(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    async with http.post(sim.url + "/tokenize", json={"messages": messages}) as resp:
        data = await resp.json()
    assert data == {
        "count": len(encode_chat(messages)),
        "max_model_len": 256,
        "tokens": encode_chat(messages),
        "token_strs": None,
    }
    async with http.post(sim.url + "/detokenize", json={"tokens": encode("a b c")}) as resp:
        assert (await resp.json()) == {"prompt": "a b c"}


async def test_health_and_version(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/health") as resp:
        assert (resp.status, await resp.read()) == (200, b"")
    async with http.get(sim.url + "/version") as resp:
        assert "version" in await resp.json()


async def test_client_disconnect_aborts_the_request(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": "hello", "max_tokens": 200, "stream": True}
    resp = await http.post(sim.url + "/v1/completions", json=body)
    await resp.content.readuntil(b"\n\n")
    assert sim.engine.num_running == 1
    resp.close()
    for _ in range(200):
        if sim.engine.stats.finished["abort"]:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.stats.finished["abort"] == 1
    assert sim.engine.num_running == 0
    assert sim.engine.kv.usage == 0.0


async def test_non_streaming_disconnect_aborts_too(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": "hello", "max_tokens": 200}
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            sim.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.05)
        ):
            pass
    for _ in range(200):
        if sim.engine.stats.finished["abort"]:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.stats.finished["abort"] == 1


async def test_metrics_page(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    ) as resp:
        assert resp.status == 200
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2.0' in text
    assert "vllm:lora_requests_info{" in text


async def test_admin_state_and_loop_lag(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    ) as resp:
        assert resp.status == 200
    async with http.get(sim.url + "/admin/state") as resp:
        state = await resp.json()
    assert (state["running"], state["generation_tokens"], state["finished"]["length"]) == (0, 2, 1)
    async with http.post(sim.url + "/admin/loop_lag") as resp:
        lag = await resp.json()
    assert lag["rss_bytes"] > 0 and "median_ms" in lag


async def test_anthropic_messages_errors_and_stop_sequences(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    """`/v1/messages` answers errors in Anthropic's shape and ends on a stop sequence."""
    turn = [{"role": "user", "content": "the model and the cache"}]
    cases: list[tuple[dict[str, Any], dict[str, str], int, str]] = [
        ({"model": "tiny", "messages": turn}, {}, 400, "invalid_request_error"),
        ({"model": "nope", "max_tokens": 2, "messages": turn}, {}, 404, "not_found_error"),
        ({"model": "tiny", "max_tokens": 2, "messages": []}, {}, 400, "invalid_request_error"),
        (
            {"model": "tiny", "max_tokens": 2, "messages": turn},
            {"X-Return-Error": "503"},
            503,
            "overloaded_error",
        ),
    ]
    for body, headers, status, kind in cases:
        async with http.post(sim.url + "/v1/messages", json=body, headers=headers) as resp:
            assert resp.status == status, body
            data = await resp.json()
            assert data["type"] == "error" and data["error"]["type"] == kind
    body = {"model": "tiny", "max_tokens": 64, "messages": turn}
    async with http.post(sim.url + "/v1/messages", json=body) as resp:
        full = (await resp.json())["content"][0]["text"]
    words = full.split()
    assert len(words) > 2
    body["stop_sequences"] = [words[2]]
    async with http.post(sim.url + "/v1/messages", json=body) as resp:
        data = await resp.json()
    assert (data["stop_reason"], data["stop_sequence"]) == ("stop_sequence", words[2])
    assert words[2] not in data["content"][0]["text"]
    assert data["usage"]["input_tokens"] > 0
