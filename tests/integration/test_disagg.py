"""Prefill/decode disaggregation and data-parallel routing on simulated replicas, end to end.

Two prefill and two decode simulators (vLLM's NIXL parameters), a gateway with a
P/D picker config; the simulators' own counters show who computed what.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from servegate.gateway.disagg import decode_request, prefill_request
from servegate.testing.cluster import SimCluster, SimHandle
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, MODEL, PICKER_HEAD, gateway_config, wait_for

ROLES = ("prefill", "prefill", "decode", "decode")
THRESHOLD = 128
PD_PICKER = {
    **PICKER_HEAD,
    "plugins": [
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "active-request-scorer"},
        {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": THRESHOLD}},
        {
            "type": "disagg-profile-handler",
            "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}},
        },
    ],
    "schedulingProfiles": [
        {
            "name": "prefill",
            "plugins": [
                {"pluginRef": "prefill-filter"},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 1},
            ],
        },
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 1},
            ],
        },
    ],
}


def document(k: int, sentences: int = 40) -> str:
    """About 12 tokens a sentence; distinct per `k` from the first block on."""
    return f"document {k} " + " ".join(
        f"section {k} line {i} of the report says the value is {i * 7}." for i in range(sentences)
    )


def pd_config(cluster: SimCluster, **disaggregation: Any) -> dict[str, Any]:
    cfg = gateway_config(cluster.urls, PD_PICKER)
    cfg["pool"]["endpoints"] = [
        {"url": url, "role": role} for url, role in zip(cluster.urls, ROLES, strict=True)
    ]
    cfg["disaggregation"] = {"mode": "gateway", **disaggregation}
    return cfg


async def ready(gw: GatewayRunner, n: int) -> None:
    pool = gw.gateway.pool
    await wait_for(
        lambda: pool.ready_count() == n and pool.resolve_model(MODEL) is not None,
        what=f"{n} ready endpoints",
    )


@pytest.fixture
async def pd_cluster() -> AsyncIterator[SimCluster]:
    overrides = [{"role": role} for role in ROLES]
    async with SimCluster(len(ROLES), base=FAST_SIM, overrides=overrides) as c:
        yield c


async def complete(
    http: aiohttp.ClientSession, gw: GatewayRunner, prompt: str, max_tokens: int = 8
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(gw.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = (await resp.text()).split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    usage: dict[str, Any] = orjson.loads(events[-2].removeprefix("data: "))["usage"]
    return usage


def received(cluster: SimCluster) -> list[int]:
    return [sim.engine.stats.requests_received for sim in cluster]


async def test_long_uncached_prompt_goes_prefill_then_decode(
    pd_cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(pd_config(pd_cluster)) as gw:
        await ready(gw, 4)
        usage = await complete(session, gw, document(1), max_tokens=8)
        (line,) = gw.access_lines()
    assert line["pd_decision"] == "prefill-decode"
    prefill = next(s for s in pd_cluster if s.address == line["prefill_endpoint"])
    decode = next(s for s in pd_cluster if s.address == line["endpoint"])
    assert (prefill.config.role, decode.config.role) == ("prefill", "decode")
    n = usage["prompt_tokens"]
    assert n > THRESHOLD
    # the prefill replica computed the whole prompt and one token
    assert prefill.engine.stats.iteration_tokens.sum == n
    # the decode replica was charged no prefill for the n − 1 transferred tokens:
    # it computed only the last prompt token, then decoded 7 more (1 + 7 = 8)
    stats = decode.engine.stats
    assert (stats.prefix_cache_hits, stats.cached_prompt_tokens) == (0, n - 1)
    assert stats.iteration_tokens.sum == 1 + 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": n - 1}
    assert line["cached_tokens"] == n - 1


async def test_short_and_cached_prompts_stay_decode_only(
    pd_cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(pd_config(pd_cluster)) as gw:
        await ready(gw, 4)
        await complete(session, gw, "a short question about the weather?")
        long_prompt = document(2)
        await complete(session, gw, long_prompt)
        before = received(pd_cluster)
        # the same document with a new question: the decode replica holds the document
        usage = await complete(session, gw, long_prompt + " What is the value in line 3?")
        lines = gw.access_lines()
    assert [line["pd_decision"] for line in lines] == [
        "decode-only",
        "prefill-decode",
        "decode-only",
    ]
    assert lines[2]["endpoint"] == lines[1]["endpoint"]
    assert lines[0]["prefill_endpoint"] is None and lines[2]["prefill_endpoint"] is None
    after = received(pd_cluster)
    assert after[:2] == before[:2], "no prefill replica saw the cached request"
    decode = next(s for s in pd_cluster if s.address == lines[2]["endpoint"])
    # the transferred blocks of the document serve the third request from the decode cache
    assert decode.engine.stats.prefix_cache_hits > THRESHOLD
    assert usage["prompt_tokens_details"]["cached_tokens"] > THRESHOLD


async def test_prefill_replica_failure_degrades_to_decode_only(
    pd_cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    cfg = pd_config(pd_cluster)
    cfg["pool"]["health"] = {"interval_s": 1.0, "timeout_s": 0.5, "failure_threshold": 2}
    async with GatewayRunner(cfg) as gw:
        await ready(gw, 4)
        for sim in pd_cluster[0], pd_cluster[1]:
            sim.fault("crash")
        usages = await asyncio.gather(*(complete(session, gw, document(10 + k)) for k in range(4)))
        await wait_for(lambda: gw.gateway.pool.ready_count() == 2, what="prefill replicas out")
        usages.append(await complete(session, gw, document(20)))
        lines = gw.access_lines()
    assert [line["status"] for line in lines] == [200] * 5
    assert all(u["completion_tokens"] == 8 for u in usages)
    # while the pool still counted them ready: decided prefill-decode, the prefill leg failed
    for line in lines[:4]:
        assert line["pd_decision"] == "prefill-decode"
        assert line["prefill_error"] is not None
        assert line["endpoint"] in (pd_cluster[2].address, pd_cluster[3].address)
    # once they are out of the pool: decode-only from the start
    assert (lines[4]["pd_decision"], lines[4]["prefill_error"]) == ("decode-only", None)
    computed = sum(pd_cluster[i].engine.stats.iteration_tokens.sum for i in (2, 3))
    # the decode replicas prefilled everything themselves: every prompt token (whose step
    # yields the first output token) plus 7 decode steps per request
    assert computed == sum(u["prompt_tokens"] for u in usages) + 7 * 5


# -- sidecar mode, with a stand-in for llm-d's routing sidecar ------------------------------


class RoutingSidecar:
    """Fronts one replica; with `x-prefiller-host-port` it runs the two NIXL legs itself."""

    def __init__(self, local: SimHandle) -> None:
        self.local = local
        self.seen: list[tuple[dict[str, str], bytes]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RoutingSidecar:
        self._http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._http is not None
        raw = await request.read()
        if request.method != "POST":
            async with self._http.get(self.local.url + request.path) as resp:
                return web.Response(status=resp.status, body=await resp.read())
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append((headers, raw))
        body = orjson.loads(raw)
        prefiller = headers.get("x-prefiller-host-port")
        if prefiller:
            leg1 = prefill_request(body)
            async with self._http.post(f"http://{prefiller}{request.path}", json=leg1) as resp:
                body = decode_request(body, (await resp.json())["kv_transfer_params"])
        async with self._http.post(self.local.url + request.path, json=body) as resp:
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )


async def test_sidecar_mode_sets_the_header_and_the_sidecar_does_the_rest(
    pd_cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    decode = pd_cluster[2]
    async with RoutingSidecar(decode) as sidecar:
        cfg = pd_config(pd_cluster, mode="sidecar")
        cfg["pool"]["endpoints"] = [
            {"url": pd_cluster[0].url, "role": "prefill"},
            {"url": sidecar.url, "role": "decode"},
        ]
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            body = {"model": MODEL, "prompt": document(3), "max_tokens": 4}
            raw = orjson.dumps(body)
            async with session.post(
                gw.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
            (line,) = gw.access_lines()
    ((headers, forwarded),) = sidecar.seen
    assert forwarded == raw, "the body reaches the sidecar byte for byte"
    assert headers["x-prefiller-host-port"] == pd_cluster[0].address
    assert (line["pd_decision"], line["prefill_status"]) == ("prefill-decode", None)
    assert pd_cluster[0].engine.stats.requests_received == 1
    n = usage["prompt_tokens"]
    assert (decode.engine.stats.prefix_cache_hits, decode.engine.stats.cached_prompt_tokens) == (
        0,
        n - 1,
    )


# -- data parallelism ------------------------------------------------------------------------


class DataParallelSidecar:
    """One port in front of several ranks: forwards to the rank in `x-data-parallel-host-port`."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> DataParallelSidecar:
        self._http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._http is not None
        rank = request.headers["x-data-parallel-host-port"]
        self.seen.append(rank)
        async with self._http.post(f"http://{rank}{request.path}", data=await request.read(), headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )


async def test_data_parallel_ranks_are_endpoints_and_the_sidecar_is_told_which(
    session: aiohttp.ClientSession,
) -> None:
    picker_doc = {
        **PICKER_HEAD,
        "plugins": [
            {"type": "data-parallel-profile-handler", "parameters": {"primaryPort": 1}},
            {"type": "round-robin-picker"},
        ],
    }
    async with SimCluster(2, base=FAST_SIM) as ranks, DataParallelSidecar() as sidecar:
        picker_doc["plugins"][0]["parameters"]["primaryPort"] = sidecar.port
        # one pod, two target ports: each rank is its own endpoint
        async with GatewayRunner(gateway_config(ranks.urls, picker_doc)) as gw:
            await ready(gw, 2)
            for _ in range(4):
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
                async with session.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
            served = [line["endpoint"] for line in gw.access_lines()]
        assert sorted(served) == sorted(ranks.addresses * 2)
        assert sidecar.seen == served
        assert [sim.engine.stats.requests_received for sim in ranks] == [2, 2]
