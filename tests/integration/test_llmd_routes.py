"""What vLLM serves behind llm-d passes through servegate, routed by model; llm-d's headers.

Routes: the OpenAI SDK (chat, models, the Responses API) and the Anthropic SDK
(`/v1/messages`, streaming and not) against simulated replicas; vLLM's routes
outside `/v1/` (`/tokenize`, `/detokenize`); any other `POST /v1/…` and the
multipart audio routes against an echo replica that reports what it received;
an OpenAI 404 when the chosen replica lacks the route.

Headers: `x-gateway-destination-endpoint-subset` (HTTP mode), `-served`,
`x-llm-d-model-name-rewrite`, and `rejected-shutting-down` while draining.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import MODEL, chat, gateway_config, wait_for, wait_ready
from tests.unit.fake_replica import fixture_page

ECHO_MODELS = ("echo-model", "echo-v2")


class EchoReplica:
    """A replica that serves every POST by echoing its path, model and body size."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> EchoReplica:
        app = web.Application()
        page = fixture_page("vllm")
        models = {"object": "list", "data": [{"id": m, "object": "model"} for m in ECHO_MODELS]}

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=page)

        async def listing(_: web.Request) -> web.Response:
            return web.json_response(models)

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", listing)
        app.router.add_post("/{tail:.*}", self._echo)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @staticmethod
    async def _echo(request: web.Request) -> web.Response:
        if request.content_type == "multipart/form-data":
            form = await request.post()
            upload = form["file"]
            assert isinstance(upload, web.FileField)
            model, size = str(form.get("model", "")), len(upload.file.read())
        else:
            raw = await request.read()
            model, size = orjson.loads(raw).get("model", ""), len(raw)
        return web.json_response({"path": request.path, "model": model, "size": size})


@pytest.fixture
async def echo() -> AsyncIterator[tuple[EchoReplica, GatewayRunner]]:
    async with EchoReplica() as replica, GatewayRunner(gateway_config([replica.url])) as gw:
        await wait_for(
            lambda: all(gw.gateway.pool.resolve_model(m) is not None for m in ECHO_MODELS),
            what="the echo replica's models",
        )
        yield replica, gw


# -- the SDKs -------------------------------------------------------------------------


async def test_openai_sdk_chat_models_and_a_route_the_replica_lacks(
    gateway: GatewayRunner,
) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert answer.choices[0].message.content
        model = await client.models.retrieve(MODEL)
        assert model.id == MODEL
        with pytest.raises(openai.NotFoundError) as missing_model:
            await client.models.retrieve("no-such-model")
        assert missing_model.value.code == "model_not_found"
        # the simulated replicas serve no /v1/responses: the gateway routes it, the replica's
        # bare 404 comes back as an OpenAI error naming the route
        with pytest.raises(openai.NotFoundError) as missing_route:
            await client.responses.create(model=MODEL, input="hello")
        assert missing_route.value.code == "not_found"
        assert "does not serve POST /v1/responses" in missing_route.value.message
    finally:
        await client.close()
    line = next(r for r in reversed(gateway.access_lines()) if r["path"] == "/v1/responses")
    assert line["model"] == MODEL and line["status"] == 404


async def test_anthropic_sdk_messages_streaming_and_not(gateway: GatewayRunner) -> None:
    client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    try:
        message = await client.messages.create(
            model=MODEL,
            max_tokens=6,
            system="be brief",
            messages=[{"role": "user", "content": "tell me a story"}],
        )
        assert message.type == "message" and message.role == "assistant"
        assert message.content[0].type == "text" and message.content[0].text
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
        async with client.messages.stream(
            model=MODEL,
            max_tokens=6,
            messages=[{"role": "user", "content": [{"type": "text", "text": "again"}]}],
        ) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == final.content[0].text != ""
        assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"
    finally:
        await client.close()
    lines = [r for r in gateway.access_lines() if r["path"] == "/v1/messages"]
    assert [(r["status"], r["stream"]) for r in lines] == [(200, False), (200, True)]
    # the gateway read Anthropic's usage names for its token accounting
    assert lines[0]["completion_tokens"] == message.usage.output_tokens
    assert lines[1]["completion_tokens"] == 6


async def test_vllm_routes_outside_v1_pass_through(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "hello world"}
    async with session.post(gateway.url + "/tokenize", json=body) as resp:
        assert resp.status == 200
        tokens = (await resp.json())["tokens"]
        served = resp.headers["x-gateway-destination-endpoint-served"]
        assert served in {s.address for s in gateway.gateway.pool}
    async with session.post(
        gateway.url + "/detokenize", json={"model": MODEL, "tokens": tokens}
    ) as resp:
        assert resp.status == 200
        assert "hello" in (await resp.json())["prompt"]
    async with session.post(gateway.url + "/v1/rerank", json={"model": "nope"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    # vLLM's model field is optional on these routes: without one, any endpoint answers
    async with session.post(gateway.url + "/tokenize", json={"prompt": "hi"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["count"] > 0
    async with session.get(gateway.url + "/v1/nothing") as resp:
        assert resp.status == 404


# -- any POST /v1/… body with a model, and multipart audio ----------------------------


async def test_any_v1_body_with_a_model_is_routed_by_it(
    echo: tuple[EchoReplica, GatewayRunner], session: aiohttp.ClientSession
) -> None:
    _, gw = echo
    raw = orjson.dumps({"model": "echo-model", "input": "x"})
    json_type = {"Content-Type": "application/json"}
    for path in ("/v1/something/new", "/v1/score", "/pooling", "/v1/audio/speech"):
        async with session.post(gw.url + path, data=raw, headers=json_type) as r:
            assert r.status == 200
            # the body reached the replica as it was sent
            assert await r.json() == {"path": path, "model": "echo-model", "size": len(raw)}
    # llm-d's model-name-rewrite header names the model the replica is asked for
    for header in ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"):
        async with session.post(
            gw.url + "/v1/something/new", json={"model": "echo-model"}, headers={header: "echo-v2"}
        ) as r:
            assert (await r.json())["model"] == "echo-v2"
            assert r.headers["x-servegate-served-model"] == "echo-v2"
    async with session.post(
        gw.url + "/v1/x",
        json={"model": "echo-model"},
        headers={"x-llm-d-model-name-rewrite": "unknown"},
    ) as r:
        assert r.status == 404
        assert "routed to `unknown`" in (await r.json())["error"]["message"]


async def test_audio_forms_are_routed_by_their_model_field(
    echo: tuple[EchoReplica, GatewayRunner], session: aiohttp.ClientSession
) -> None:
    _, gw = echo
    audio = bytes(range(256)) * 40

    def form(model: str) -> aiohttp.FormData:
        data = aiohttp.FormData()
        data.add_field("file", audio, filename="a.wav", content_type="audio/wav")
        data.add_field("model", model)
        return data

    async with session.post(gw.url + "/v1/audio/transcriptions", data=form("echo-model")) as r:
        assert r.status == 200
        assert await r.json() == {
            "path": "/v1/audio/transcriptions",
            "model": "echo-model",
            "size": len(audio),
        }
    async with session.post(
        gw.url + "/v1/audio/translations",
        data=form("echo-model"),
        headers={"x-llm-d-model-name-rewrite": "echo-v2"},
    ) as r:
        assert (await r.json())["model"] == "echo-v2"
    async with session.post(gw.url + "/v1/audio/transcriptions", data=form("gone")) as r:
        assert r.status == 404


# -- headers --------------------------------------------------------------------------


async def test_subset_header_narrows_the_candidates(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    addresses = sorted(s.address for s in gateway.gateway.pool)
    chosen = addresses[1]
    subset = f"10.255.0.1:8000, {chosen}"  # a non-member is ignored
    used: Counter[str] = Counter()
    for i in range(9):
        async with session.post(
            gateway.url + "/v1/chat/completions",
            json=chat(f"question {i}"),
            headers={"x-gateway-destination-endpoint-subset": subset},
        ) as resp:
            assert resp.status == 200
            used[resp.headers["x-gateway-destination-endpoint-served"]] += 1
            assert resp.headers["x-gateway-destination-endpoint"] == chosen
    assert used == Counter({chosen: 9})
    async with session.post(
        gateway.url + "/v1/chat/completions",
        json=chat(),
        headers={"x-gateway-destination-endpoint-subset": ""},
    ) as resp:
        assert resp.status == 503
        assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


async def test_draining_turns_requests_away_as_shutting_down(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(gateway_config(cluster.urls)) as gw:
        await wait_ready(gw, len(cluster))
        await gw.app.on_shutdown.send(gw.app)  # what a SIGTERM starts: the queues close
        async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
            assert resp.status == 503
            assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-shutting-down"
            assert (await resp.json())["error"]["code"] == "rejected-shutting-down"
        text = await (await session.get(gw.url + "/metrics")).text()
        assert 'error_code="ServiceUnavailable"' in text
        await asyncio.sleep(0)
