"""Shared-prefix chat traffic on simulated replicas, for the routing benches (not a test).

`bench_cache_routing.py` and `scaleout.py` measure prefix-cache hit rates the same
way: the same workload (prefix groups, a fresh question per request), the same
simulated replicas and gateway settings, closed-loop clients, and the hit rate from
the simulators' own counters. Kept here so their numbers stay comparable.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from servegate.simulator import tokenizer as sim_tokenizer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

MODEL = "sim-model"


@dataclass
class Workload:
    prefixes: list[str]
    requests: list[tuple[int, str]]
    """(group, question) per request, in send order."""


def words(rng: random.Random, n: int) -> str:
    return sim_tokenizer.decode(rng.choice(sim_tokenizer.WORD_IDS) for _ in range(n))


def make_workload(
    groups: int, prefix_words: int, requests: int, hot_share: float | None, seed: int
) -> Workload:
    rng = random.Random(seed)
    prefixes = [f"group {g}:" + words(rng, prefix_words) for g in range(groups)]
    out = []
    for i in range(requests):
        if hot_share is not None and rng.random() < hot_share:
            group = 0
        else:
            group = rng.randrange(groups) if hot_share is None else rng.randrange(1, groups)
        out.append((group, f"question {i}:" + words(rng, 24)))
    return Workload(prefixes, out)


def body(workload: Workload, group: int, question: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": workload.prefixes[group]},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
    }


def sim_config(num_blocks: int, speed: float, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "block_size": 16,
        "num_blocks": num_blocks,
        "max_model_len": 2048,
        "speed": speed,
        **extra,
    }


def gateway_config(endpoints: list[dict[str, Any]], **pool: Any) -> dict[str, Any]:
    return {
        "gateway": {"port": 0, "seed": 7, "access_log": False},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 1.0},
            "endpoints": endpoints,
            **pool,
        },
    }


async def wait_ready(gw: GatewayRunner, n: int, timeout: float = 10.0) -> None:
    pool = gw.gateway.pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool.ready_count() == n and all(s.metrics.scraped_at > 0 for s in pool):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(f"{n} replicas not ready in {timeout} s")


async def drive(
    workload: Workload,
    concurrency: int,
    max_tokens: int,
    url_for: Callable[[int, int], str],
    on_ok: Callable[[int, aiohttp.ClientResponse], None] | None = None,
) -> int:
    """Closed-loop clients send every request, request i of group g to `url_for(i, g)`;
    `on_ok(g, response)` sees each 200. Returns the number of other answers."""
    queue = list(enumerate(workload.requests))
    queue.reverse()
    errors = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while queue:
            i, (group, question) = queue.pop()
            payload = body(workload, group, question, max_tokens)
            async with session.post(
                url_for(i, group) + "/v1/chat/completions", json=payload
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                elif on_ok is not None:
                    on_ok(group, resp)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return errors


Snapshot = list[tuple[int, int, int]]


def snapshot(cluster: SimCluster) -> Snapshot:
    """Per replica: prefix-cache hits, queries (tokens) and requests, from its own counters."""
    return [
        (e.stats.prefix_cache_hits, e.stats.prefix_cache_queries, e.stats.requests_received)
        for e in cluster.engines
    ]


def totals(cluster: SimCluster, before: Snapshot) -> tuple[float, list[int]]:
    now = snapshot(cluster)
    hits = sum(n[0] - b[0] for n, b in zip(now, before, strict=True))
    queries = sum(n[1] - b[1] for n, b in zip(now, before, strict=True))
    per_replica = [n[2] - b[2] for n, b in zip(now, before, strict=True)]
    return (hits / queries if queries else 0.0), per_replica
