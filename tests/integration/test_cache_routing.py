"""Cache-aware routing end to end: simulators' KV events, the precise index, the gateway."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from servegate.datalayer.kvevents import KVEventsManager, KVEventsSettings
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool
from servegate.scheduling.affinity import decode_token
from servegate.scheduling.prefix.precise import PreciseIndex
from servegate.simulator import tokenizer as sim_tokenizer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

from .conftest import MODEL, PICKER_HEAD, gateway_config, wait_for, wait_ready

BLOCK = 16
SIM = {"model": MODEL, "speed": 20.0, "num_blocks": 256, "block_size": BLOCK, "max_model_len": 2048}
PREFIX = "the system prompt explains the cache and the prefix of every request " * 12


def messages(question: str, prefix: str = PREFIX) -> list[dict[str, str]]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


async def chat(
    session: aiohttp.ClientSession, url: str, msgs: list[dict[str, str]], model: str = MODEL
) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": model, "messages": msgs, "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), dict(resp.headers)


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def settle(index: PreciseIndex, address: str, ids: list[int], lora: str | None) -> None:
    """Until the index holds every full block of `ids` on `address` (events are async)."""
    await wait_for(
        lambda: index.matched_blocks(address, ids, lora) == len(ids) // BLOCK,
        what=f"{len(ids) // BLOCK} blocks of the prompt in the index",
    )


async def test_the_index_predicts_the_simulators_cached_tokens(
    session: aiohttp.ClientSession,
) -> None:
    sim = {**SIM, "lora": {"adapters": ["a1"], "max_loras": 1}}
    async with SimCluster(2, base=sim, kv_events="ipc") as cluster:
        pool = Pool()
        for s in cluster:
            pool.add(Endpoint(address=s.address, url=s.url, kv_events=s.kv_events_endpoint))
        index = PreciseIndex()
        manager = KVEventsManager(pool, [index])
        await manager.start()
        try:
            await manager.wait_ready()
            url, address = cluster.urls[0], cluster.addresses[0]
            # a subscription takes a moment to reach the publisher: send until one arrives
            for i in range(50):
                await chat(session, url, messages(f"join {i}", prefix="join " * 40))
                await asyncio.sleep(0.05)
                if index.blocks(address):
                    break
            probes = [
                ("cold", messages("what is a block?"), MODEL, None),
                ("same-prefix-new-question", messages("what is a prefix?"), MODEL, None),
                ("repeat", messages("what is a prefix?"), MODEL, None),
                (
                    "half-shared",
                    messages("q", prefix=PREFIX[: len(PREFIX) // 2] + "x" * 40),
                    MODEL,
                    None,
                ),
                ("adapter-shares-nothing-with-base", messages("what is a prefix?"), "a1", "a1"),
                ("adapter-repeat", messages("what is a prefix?"), "a1", "a1"),
            ]
            results = []
            for name, msgs, model, lora in probes:
                ids = sim_tokenizer.encode_chat(msgs)
                predicted = index.predicted_hit_tokens(address, ids, lora)
                answer, _ = await chat(session, url, msgs, model)
                results.append((name, predicted, cached_tokens(answer)))
                await settle(index, address, ids, lora)
            assert [(n, p) for n, p, _ in results] == [(n, a) for n, _, a in results]
            by_name = {n: p for n, p, _ in results}
            assert by_name["cold"] == 0 and by_name["adapter-shares-nothing-with-base"] == 0
            assert by_name["repeat"] > by_name["half-shared"] > 0
            # the other replica holds nothing of it
            assert index.predicted_hit_tokens(cluster.addresses[1], ids, None) == 0
            stats = manager.stats()[address]
            assert stats.gaps == 0 and stats.dropped == {} and stats.batches > 0
        finally:
            await manager.stop()


async def test_a_late_subscriber_replays_what_it_missed(session: aiohttp.ClientSession) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        replay = f"ipc://{tmp}/replay-0.sock"
        override = [{"kv_events": {"replay_endpoint": replay}}]
        async with SimCluster(1, base=SIM, kv_events="ipc", overrides=override) as cluster:
            sim = cluster[0]
            early = messages("published before anyone listened")
            await chat(session, sim.url, early)
            # the publisher's thread sends it later: missed only if sent before we subscribe
            publisher = sim.state.publisher
            assert publisher is not None
            await wait_for(lambda: publisher.published > 0, what="the early batch sent")
            pool = Pool()
            pool.add(
                Endpoint(
                    address=sim.address,
                    url=sim.url,
                    kv_events=sim.kv_events_endpoint,
                    kv_events_replay=replay,
                )
            )
            index = PreciseIndex()
            manager = KVEventsManager(pool, [index], KVEventsSettings(replay_timeout_s=2.0))
            await manager.start()
            try:
                await manager.wait_ready()
                for i in range(50):  # any later batch reveals how much was missed
                    await chat(session, sim.url, messages(f"later {i}", prefix=f"{i} " * 40))
                    await asyncio.sleep(0.05)
                    if manager.stats()[sim.address].batches:
                        break
                ids = sim_tokenizer.encode_chat(early)
                await settle(index, sim.address, ids, None)
                stats = manager.stats()[sim.address]
                assert stats.replays == 1 and stats.replayed_batches >= 1
                assert stats.missed_batches == 0
            finally:
                await manager.stop()


def picker(*scorers: tuple[str, float]) -> dict[str, Any]:
    return {
        **PICKER_HEAD,
        "plugins": [{"type": t} for t, _ in scorers],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": t, "weight": w} for t, w in scorers]}
        ],
    }


def cache_config(cluster: SimCluster, picker_doc: dict[str, Any] | None) -> dict[str, Any]:
    cfg = gateway_config(cluster.urls, picker_doc, debug_headers=True)
    cfg["pool"]["tokenizer"] = {"source": "simulator"}
    for entry, sim in zip(cfg["pool"]["endpoints"], cluster, strict=True):
        entry["kv_events"] = sim.kv_events_endpoint
    return cfg


async def test_the_default_profile_follows_the_prefix_and_exports_the_index(
    session: aiohttp.ClientSession,
) -> None:
    async with (
        SimCluster(3, base=SIM, kv_events="ipc") as cluster,
        GatewayRunner(cache_config(cluster, None)) as gw,
    ):
        await wait_ready(gw, 3)
        routing = gw.gateway.cache_routing
        assert routing.kv_events is not None and routing.tokenizers is not None
        await routing.kv_events.wait_ready()
        _, headers = await chat(session, gw.url, messages("question 0"))
        home = headers["x-gateway-destination-endpoint"]
        served = []
        for i in range(1, 6):
            answer, headers = await chat(session, gw.url, messages(f"question {i}"))
            served.append(headers["x-gateway-destination-endpoint"])
            assert cached_tokens(answer) > 0
        assert served == [home] * 5
        async with session.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert f'servegate_prefix_index_blocks{{endpoint="{home}"' in text
        assert "servegate_kv_events_batches_total" in text


async def hot_run(session: aiohttp.ClientSession, picker_doc: dict[str, Any] | None) -> set[str]:
    """One warm-up request, then 12 clients sending 4 requests each of the same prefix, one
    after the other (replicas have 2 sequence slots): which replicas served them."""
    sim = {**SIM, "speed": 1.0, "max_num_seqs": 2}
    async with (
        SimCluster(3, base=sim, kv_events="ipc") as cluster,
        GatewayRunner(cache_config(cluster, picker_doc)) as gw,
    ):
        await wait_ready(gw, 3)
        manager = gw.gateway.cache_routing.kv_events
        assert manager is not None
        await manager.wait_ready()
        await asyncio.sleep(0.2)
        await chat(session, gw.url, messages("warm-up"))
        await asyncio.sleep(0.2)
        served: set[str] = set()

        async def client(c: int) -> None:
            for i in range(4):
                _, headers = await chat(session, gw.url, messages(f"hot {c}.{i}"))
                served.add(headers["x-gateway-destination-endpoint"])

        await asyncio.gather(*(client(c) for c in range(12)))
        return served


async def test_a_hot_prefix_spreads_under_the_default_profile(
    session: aiohttp.ClientSession,
) -> None:
    assert len(await hot_run(session, None)) >= 2


async def test_without_load_scorers_a_hot_prefix_pins_one_replica(
    session: aiohttp.ClientSession,
) -> None:
    assert len(await hot_run(session, picker(("precise-prefix-cache-scorer", 1)))) == 1


async def test_session_token_round_trip(session: aiohttp.ClientSession) -> None:
    doc = picker(("session-affinity-scorer", 10), ("queue-scorer", 1))
    async with (
        SimCluster(3, base=SIM) as cluster,
        GatewayRunner(gateway_config(cluster.urls, doc)) as gw,
    ):
        await wait_ready(gw, 3)
        _, headers = await chat(session, gw.url, messages("hello"))
        token = headers["x-session-token"]
        home = decode_token(token)
        assert home == headers["x-gateway-destination-endpoint"]
        for i in range(5):
            body = {"model": MODEL, "messages": messages(f"q{i}"), "max_tokens": 2}
            async with session.post(
                gw.url + "/v1/chat/completions", json=body, headers={"x-session-token": token}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-destination-endpoint"] == home
