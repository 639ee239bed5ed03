"""Routing quality with nothing configured, judged by the simulated replicas' own counters.

4 simulated vLLM replicas with 3,840 tokens of KV cache each; 12 prefix groups of
~420 tokens (5,040 in all: more than one replica holds, less than the cluster);
240 chats, group drawn at random, a fresh question each, 8 closed-loop clients.
Round-robin spreads every group over every replica, so each replica cycles all
12 prefixes through room for ~9; a router that keeps each group on one replica
keeps them all cached.

The gateway runs with only the endpoint URLs (what `servegate serve --endpoint …`
gives): the default profile and `tokenizer: auto`, which here learns the
simulator's `/tokenize`. The approximate index reaches the decision two ways in the
default profile: through `prefix-cache-affinity-filter` (sticky until saturated) and
through `prefix-cache-scorer`'s weight; either alone keeps this workload cached.
Measured on this machine (2026-12-02, one run of `hit_rate` per variant at load
average 14–25, real vLLM running beside): round-robin 55.8 %,
the zero-config default 84.4 % (max/mean 1.17); broken: the approximate scorer
scoring zeros 55.8 %, its `pre_request` recording nothing 58.0 %, the scheduler
calling no `pre_request` hook 58.1 %, the prefix weight 0 and no affinity filter
57.3 %; each route alone: prefix weight 0 with the filter 86.7 %, the filter gone
with the weight 84.8 %. Hence the bound: the default must beat round-robin by
`MARGIN` (20) points, and the same check is shown to fail for each breakage above.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
import yaml

from servegate.scheduling.config import DEFAULT_PICKER_CONFIG
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.simulator import tokenizer as sim_tokenizer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

from .conftest import MODEL, gateway_config, wait_ready

REPLICAS = 4
GROUPS = 12
PREFIX_WORDS = 400
REQUESTS = 240
CLIENTS = 8
SIM = {
    "model": MODEL,
    "speed": 50.0,
    "num_blocks": 240,
    "block_size": 16,
    "max_model_len": 2048,
}
MARGIN = 0.2
"""Hit-rate points the zero-config default must gain over round-robin."""
ROUND_ROBIN = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "round-robin-picker"}],
}


def workload(seed: int = 3) -> tuple[list[str], list[tuple[int, str]]]:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return sim_tokenizer.decode(rng.choice(sim_tokenizer.WORD_IDS) for _ in range(n))

    prefixes = [f"group {g}:" + words(PREFIX_WORDS) for g in range(GROUPS)]
    requests = [(rng.randrange(GROUPS), f"question {i}:" + words(16)) for i in range(REQUESTS)]
    return prefixes, requests


async def drive(url: str, prefixes: Sequence[str], requests: Sequence[tuple[int, str]]) -> None:
    queue = list(reversed(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            group, question = queue.pop()
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": prefixes[group]},
                    {"role": "user", "content": question},
                ],
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))


async def hit_rate(picker: dict[str, Any] | None) -> tuple[float, list[int]]:
    """Cluster hit rate and requests per replica, from the simulators' own counters."""
    prefixes, requests = workload()
    async with SimCluster(REPLICAS, base=SIM) as cluster:
        async with GatewayRunner(gateway_config(cluster.urls, picker)) as gw:
            await wait_ready(gw, REPLICAS)
            await drive(gw.url, prefixes, requests)
        engines = cluster.engines
        hits = sum(e.stats.prefix_cache_hits for e in engines)
        queries = sum(e.stats.prefix_cache_queries for e in engines)
        per_replica = [e.stats.requests_received for e in engines]
    assert sum(per_replica) == REQUESTS
    return hits / queries, per_replica


@pytest.fixture(scope="module")
def round_robin() -> float:
    rate, _ = asyncio.run(hit_rate(ROUND_ROBIN))
    return rate


async def test_the_zero_config_default_beats_round_robin(round_robin: float) -> None:
    rate, per_replica = await hit_rate(None)
    assert rate >= round_robin + MARGIN, (rate, round_robin, per_replica)
    assert max(per_replica) / (REQUESTS / REPLICAS) <= 1.5, per_replica


def without_prefix_routes() -> dict[str, Any]:
    """The default profile with the prefix scorer's weight 0 and no affinity filter."""
    doc = yaml.safe_load(DEFAULT_PICKER_CONFIG)
    doc["plugins"] = [p for p in doc["plugins"] if p["type"] != "prefix-cache-affinity-filter"]
    refs = []
    for ref in doc["schedulingProfiles"][0]["plugins"]:
        if ref["pluginRef"] == "prefix-cache-affinity-filter":
            continue
        if ref["pluginRef"] == "prefix-cache-scorer":
            ref = {**ref, "weight": 0}
        refs.append(ref)
    doc["schedulingProfiles"][0]["plugins"] = refs
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize("broken", ["score-zeros", "no-pre-request", "no-prefix-route"])
async def test_the_bound_fails_when_the_approximate_scorer_breaks(
    round_robin: float, broken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    picker: dict[str, Any] | None = None
    if broken == "score-zeros":
        # `match` is the scorer's own computation: `score` and the default profile's
        # one-call path (scheduling/sticky.py) both read it
        monkeypatch.setattr(PrefixCacheScorer, "match", lambda self, request, eps: [0.0] * len(eps))
    elif broken == "no-pre-request":
        # (the scheduler that calls it and the index it feeds are compiled, native.txt:
        # their methods cannot be patched, so the scorer's own is the seam)
        monkeypatch.setattr(PrefixCacheScorer, "pre_request", lambda self, *a: None)
    else:
        picker = without_prefix_routes()
    rate, per_replica = await hit_rate(picker)
    assert rate < round_robin + MARGIN, (rate, round_robin, per_replica)
