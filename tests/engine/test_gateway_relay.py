"""Completions and chat through `servegate serve` are byte-for-byte the engine's answer.

Each request is sent once straight to a vLLM server and once through the gateway.
Greedy decoding (temperature 0, a fixed seed) makes the engine's answer a function
of the request, and every server loads the same weights, so wherever the gateway
routes, the bytes must match except the per-request `id` and `created` values.
Prompts stay under one KV block (32 tokens): a prefix-cache hit changes the shape
of the prefill computation, and with it, on CPU, possibly a greedy choice.

Whole answers are compared byte for byte. Streams cannot be: when its API process
falls behind the engine (a busy 2-core machine), vLLM merges pending token deltas
into one event, so where the event boundaries fall varies from run to run on the
engine alone. A stream is compared by its concatenated text and by what does not depend
on those boundaries: object and model of every event, the role event, the finish
reasons, the fields of the last choice event, the usage event and one `[DONE]`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from gateway_process import GatewayProcess

from servegate.testing.vllm_cluster import VllmCluster, http_request

VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|[0-9]+)')

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("completion", "/v1/completions", {"model": "tiny", "prompt": "the router picks a replica"}),
    (
        "completion-stream",
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "the router picks a replica",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hello gateway"}]},
    ),
    (
        "chat-stream",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello gateway"}],
            "stream": True,
        },
    ),
    ("completion-lora", "/v1/completions", {"model": "a1", "prompt": "adapter one speaks"}),
    (
        "chat-lora-stream",
        "/v1/chat/completions",
        {
            "model": "a2",
            "messages": [{"role": "user", "content": "adapter two speaks"}],
            "stream": True,
        },
    ),
]


def normalise(raw: bytes) -> bytes:
    return VOLATILE.sub(rb'"\1":_', raw)


def sse_events(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def deltas(events: list[Any]) -> str:
    out = []
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def _keys(event: dict[str, Any]) -> list[Any]:
    """The event's field names, its choices' and their deltas', without values."""
    choices = [
        sorted([*c, *(f"delta.{k}" for k in c.get("delta") or {})]) for c in event["choices"]
    ]
    return [sorted(event), choices]


def shape(events: list[Any]) -> dict[str, Any]:
    """What a stream must carry whatever the event boundaries: see the module docstring."""
    data = [e for e in events if e != "[DONE]"]
    roles = [c["delta"]["role"] for e in data for c in e["choices"] if "role" in c.get("delta", {})]
    return {
        "objects": sorted({(e["object"], e["model"]) for e in data}),
        "roles": roles,
        "first_role_event": _keys(data[0]) if roles else None,
        "finish_reasons": [
            c["finish_reason"] for e in data for c in e["choices"] if c.get("finish_reason")
        ],
        "last_choice_event": _keys([e for e in data if e["choices"]][-1]),
        "usage": [e["usage"] for e in data if e.get("usage")],
        "done": events[-1] == "[DONE]" and events.count("[DONE]") == 1,
    }


@pytest.mark.parametrize(("path", "body"), [(p, b) for _, p, b in CASES], ids=[c[0] for c in CASES])
def test_gateway_answer_is_the_engines(
    cluster: VllmCluster, gateway: GatewayProcess, path: str, body: dict[str, Any]
) -> None:
    request = {**body, "temperature": 0, "seed": 7, "max_tokens": 16}
    direct_status, direct_headers, direct = http_request(cluster[0].url + path, request)
    status, headers, via = gateway.post(path, request, headers={"X-Request-ID": "engine-relay"})

    assert (status, direct_status) == (200, 200), via[:500]
    assert headers["content-type"] == direct_headers["content-type"]
    assert headers["x-request-id"] == "engine-relay"
    assert headers["x-gateway-destination-endpoint"] in {s.address for s in cluster}
    if body.get("stream"):
        events, direct_events = sse_events(via), sse_events(direct)
        assert deltas(events) == deltas(direct_events)
        assert shape(events) == shape(direct_events)
        assert events[-1] == "[DONE]"
        assert len(events) > 2
    else:
        assert normalise(via).decode() == normalise(direct).decode()
        doc = json.loads(via)
        assert doc["usage"]["completion_tokens"] == 16


def test_stream_carries_the_same_text_as_the_whole_answer(gateway: GatewayProcess) -> None:
    request = {"model": "tiny", "prompt": "stream versus whole", "temperature": 0, "max_tokens": 24}
    _, _, whole = gateway.post("/v1/completions", request)
    _, _, stream = gateway.post("/v1/completions", {**request, "stream": True})
    assert deltas(sse_events(stream)) == json.loads(whole)["choices"][0]["text"]


def test_engine_errors_pass_through_unchanged(
    cluster: VllmCluster, gateway: GatewayProcess
) -> None:
    # 3000 tokens of output cannot fit --max-model-len 2048: vLLM answers 400 itself.
    request = {"model": "tiny", "prompt": "too long", "max_tokens": 3000}
    direct_status, _, direct = http_request(cluster[0].url + "/v1/completions", request)
    status, _, via = gateway.post("/v1/completions", request)
    assert (status, direct_status) == (400, 400)
    assert normalise(via) == normalise(direct)
