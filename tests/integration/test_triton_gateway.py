"""The Triton persona behind the gateway: OpenAI completions and chat, streaming or not, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.gateway.triton import TRITON_ENGINE
from servegate.simulator import tokenizer as sim_tokenizer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.disagg_pickers import PD_HANDLER, disagg_picker
from tests.integration.conftest import MODEL, wait_for

TRITON_SIM = {
    "model": MODEL,
    "persona": TRITON_ENGINE,
    "speed": 50.0,
    "num_blocks": 256,
    "block_size": 16,
    "max_model_len": 2048,
}


def triton_config(cluster: SimCluster, **pool: Any) -> dict[str, Any]:
    return {
        "gateway": {"seed": 7, "port": 0, "max_retries": 1},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 2},
            "endpoints": [
                {
                    "url": h.url,
                    "engine": TRITON_ENGINE,
                    "model": MODEL,
                    "metrics_url": h.metrics_url,
                }
                for h in cluster
            ],
            **pool,
        },
    }


@pytest.fixture
async def triton_cluster() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, base=TRITON_SIM) as c:
        yield c


@pytest.fixture
async def triton_gateway(triton_cluster: SimCluster) -> AsyncIterator[GatewayRunner]:
    cfg = triton_config(triton_cluster)
    async with GatewayRunner(cfg) as gw:
        pool = gw.gateway.pool
        await wait_for(
            lambda: pool.ready_count() == 2 and all(s.metrics.scraped_at > 0 for s in pool),
            what="2 ready Triton endpoints",
        )
        yield gw


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


async def test_models_lists_the_declared_model(
    triton_gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    async with session.get(triton_gateway.url + "/v1/models") as resp:
        ids = [m["id"] for m in (await resp.json())["data"]]
    assert ids == [MODEL]


@pytest.mark.parametrize(
    ("path", "body", "object_"),
    [
        pytest.param(
            "/v1/completions",
            {"prompt": "the quick brown fox", "max_tokens": 5},
            "text_completion",
            id="completion",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
            "chat.completion",
            id="chat",
        ),
    ],
)
async def test_non_streaming(
    triton_gateway: GatewayRunner,
    session: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    object_: str,
) -> None:
    async with session.post(
        triton_gateway.url + path, json={"model": MODEL, **body}, headers={"X-Request-ID": "r1"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
    assert doc["object"] == object_
    assert doc["model"] == MODEL
    assert doc["id"].endswith("-r1")
    choice = doc["choices"][0]
    text = choice["message"]["content"] if object_ == "chat.completion" else choice["text"]
    assert text and not text.startswith("the quick brown fox")
    assert choice["finish_reason"] in ("stop", "length")
    usage = doc["usage"]
    assert usage["token_count_source"] == "estimate"
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    line = triton_gateway.access_lines()[-1]
    assert (line["status"], line["completion_tokens"]) == (200, usage["completion_tokens"])


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_streaming_with_usage(
    triton_gateway: GatewayRunner, session: aiohttp.ClientSession, chat: bool
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "tell me"}]
    else:
        body["prompt"] = "tell me"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(triton_gateway.url + path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] in ("stop", "length")
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert len(text.split()) >= 1
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_stream_without_usage_option_has_no_usage_chunk(
    triton_gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    async with session.post(triton_gateway.url + "/v1/completions", json=body) as resp:
        events = sse_events(await resp.text())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in chunks)
    line = triton_gateway.access_lines()[-1]
    assert line["stream"] is True and line["completion_tokens"] is not None


async def test_midstream_error_becomes_openai_error_then_done(
    triton_gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
    headers = {"X-Return-Error": "stream_error"}
    async with session.post(
        triton_gateway.url + "/v1/completions", json=body, headers=headers
    ) as resp:
        assert resp.status == 200
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "upstream_failed"
    assert "Simulated failure during generation" in error["message"]
    line = triton_gateway.access_lines()[-1]
    assert line["error"].startswith("midstream:")
    errors = triton_gateway.gateway.metrics.upstream_errors
    assert errors.labels(line["endpoint"], "midstream")._value.get() == 1


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        pytest.param(
            {"prompt": "x", "max_tokens": 3}, {"X-Return-Error": "400"}, 400, None, id="triton-400"
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": 3},
            {"X-Return-Error": "500"},
            502,
            "upstream_failed",
            id="triton-500",
        ),
        pytest.param({"prompt": "x", "max_tokens": 3, "n": 2}, {}, 400, None, id="n-unsupported"),
        pytest.param({"prompt": [1, 2, 3]}, {}, 400, None, id="token-prompt"),
        pytest.param({"prompt": "x", "logprobs": 2}, {}, 400, None, id="logprobs-unsupported"),
    ],
)
async def test_errors_are_openai_errors(
    triton_gateway: GatewayRunner,
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    async with session.post(
        triton_gateway.url + "/v1/completions", json={"model": MODEL, **body}, headers=headers
    ) as resp:
        assert resp.status == status
        doc = await resp.json()
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == code
    assert doc["error"]["message"]


async def test_unknown_triton_model_name_is_404(session: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base=TRITON_SIM) as cluster:
        cfg = triton_config(cluster)
        cfg["pool"]["endpoints"][0]["labels"] = {"servegate.io/triton-model": "ensemble"}
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready")
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 404
                doc = await resp.json()
    assert doc["error"]["code"] == "model_not_found"
    assert "ensemble" in doc["error"]["message"]


async def test_simulator_tokenizer_counts_exactly(session: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base=TRITON_SIM) as cluster:
        cfg = triton_config(cluster, tokenizer={"source": "simulator"})
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready")
            body = {"model": MODEL, "prompt": "one two three", "max_tokens": 4}
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                doc = await resp.json()
    assert doc["usage"]["token_count_source"] == "tokenizer"
    assert doc["usage"]["completion_tokens"] == 4
    assert doc["choices"][0]["finish_reason"] == "length"


async def test_declared_chat_template_renders_the_prompt(session: aiohttp.ClientSession) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}>>"
    async with SimCluster(1, base=TRITON_SIM) as cluster:
        cfg = triton_config(
            cluster,
            tokenizer={"source": "simulator"},
            models=[{"id": MODEL, "chat_template": template}],
        )
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready")
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "alpha beta"}],
                "max_tokens": 2,
            }
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                doc = await resp.json()
    assert doc["usage"]["prompt_tokens"] == len(sim_tokenizer.encode("[user] alpha beta >>"))


async def test_fallback_from_vllm_to_triton_translates_per_attempt(
    session: aiohttp.ClientSession,
) -> None:
    failing_vllm = {
        **TRITON_SIM,
        "persona": "vllm",
        "faults": {"error_rate": 1.0, "error_kinds": [503]},
    }
    async with SimCluster(2, base=TRITON_SIM, overrides=[failing_vllm, {}]) as cluster:
        cfg = triton_config(cluster)
        cfg["pool"]["endpoints"][0] = {"url": cluster[0].url, "model": MODEL}
        cfg["picker"] = {
            "apiVersion": "llm-d.ai/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [{"type": "random-picker", "parameters": {"maxNumOfEndpoints": 2}}],
        }
        cfg["retries"] = {"backoff_base_s": 0.0}
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 2, what="ready")
            for stream in (False, True, False, True, False, True):
                body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream}
                async with session.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-gateway-destination-endpoint"] == cluster[1].address
                    text = await resp.text()
                assert text.endswith("data: [DONE]\n\n") if stream else "text_completion" in text
            retried = [line for line in gw.access_lines() if line["retries"] == 1]
            triton_address = cluster[1].address
    assert retried and all(line["endpoint"] == triton_address for line in retried)


async def test_disaggregation_runs_decode_only_for_triton(session: aiohttp.ClientSession) -> None:
    async with SimCluster(2, base=TRITON_SIM) as cluster:
        cfg = triton_config(cluster)
        cfg["pool"]["endpoints"][0]["role"] = "prefill"
        cfg["pool"]["endpoints"][1]["role"] = "decode"
        cfg["picker"] = disagg_picker(PD_HANDLER)
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 2, what="ready")
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["object"] == "text_completion"
            decode_address = cluster[1].address
            (line,) = gw.access_lines()
            fallbacks = gw.gateway.metrics.registry.get_sample_value(
                "servegate_disagg_prefill_fallbacks_total", {"reason": "unsupported_engine"}
            )
    assert line["endpoint"] == decode_address
    assert line["prefill_error"] == "P/D disaggregation does not support Triton endpoints"
    assert fallbacks == 1
