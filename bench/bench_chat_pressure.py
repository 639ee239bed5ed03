"""Placement under cache pressure on simulated replicas: which profile keeps caches.

    .venv/bin/python bench/bench_chat_pressure.py --clients 1 4 --seeds 0 1 2
    .venv/bin/python bench/bench_chat_pressure.py --workloads shared shared-many chat \
        --clients 1 4 8 --seeds 0 1 2 --profiles default default-no-hit sticky-no-hit

The workloads of `bench_real_peers.py` (default `chat`: 8 active conversations of 6
turns, each with its own system prompt; 30 conversations ≈ 2.8× the cluster's KV
cache; `shared`, `shared-many`, `chat-heavy`, …; `--clients` overrides their
concurrency) on 3 simulated vLLM replicas with 4,096 tokens of KV cache each (256 blocks of 16,
the real-vLLM bench's size), through gateways that differ only in their picker;
`oracle` sends conversation c to replica c mod 3. The hit rate comes from the
simulators' own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench_real_peers import Item, workload
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

MODEL = "sim-model"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 256, "max_model_len": 2048, "speed": 20.0}
HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
LOAD = [("queue-scorer", 2), ("kv-cache-utilization-scorer", 2), ("active-request-scorer", 2)]


def picker(
    scorers: Sequence[tuple[str, float]], filters: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = [*filters, *({"type": t} for t, _ in scorers)]
    plugins.append({"type": "max-score-picker"})
    refs = [{"pluginRef": f.get("name", f["type"])} for f in filters]
    refs += [{"pluginRef": t, "weight": w} for t, w in scorers]
    refs.append({"pluginRef": "max-score-picker"})
    return {**HEAD, "plugins": plugins, "schedulingProfiles": [{"name": "d", "plugins": refs}]}


STICKY = {
    "type": "prefix-cache-affinity-filter",
    "parameters": {"prefixMatchInfoProducerName": "prefix-cache-scorer"},
}
SATURATED = {**STICKY, "parameters": {**STICKY["parameters"], "maxInFlightRequestsDelta": 3}}
OLD_DEFAULT = [
    ("precise-prefix-cache-scorer", 1),
    ("prefix-cache-scorer", 3),
    *LOAD,
    ("lora-affinity-scorer", 1),
]
PROFILES: dict[str, dict[str, Any] | None] = {
    "round-robin": {**HEAD, "plugins": [{"type": "round-robin-picker"}]},
    "default": None,
    "llm-d-sticky": picker([("prefix-cache-scorer", 0), ("token-load-scorer", 1)], [STICKY]),
    "sticky+prefix": picker([("prefix-cache-scorer", 3), *LOAD], [STICKY]),
    "sticky-saturated": picker(
        [("precise-prefix-cache-scorer", 1), ("prefix-cache-scorer", 3), *LOAD],
        [SATURATED],
    ),
    "prefix-heavy": picker([("precise-prefix-cache-scorer", 1), ("prefix-cache-scorer", 6), *LOAD]),
    # the default before the affinity filter and no-hit-lru-scorer joined it (2026-12-02)
    "default-old": picker(OLD_DEFAULT),
    # candidates measured for the new default (no-hit-lru at weight 2)
    "default-no-hit": picker([*OLD_DEFAULT, ("no-hit-lru-scorer", 2)]),
    "sticky-no-hit": picker([*OLD_DEFAULT, ("no-hit-lru-scorer", 2)], [SATURATED]),
}


async def drive(url_for: Any, items: Sequence[Item], clients: int) -> None:
    queue = list(reversed(items))

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            item = queue.pop()
            body = {**item.body, "model": MODEL}
            async with session.post(url_for(item) + item.path, json=body) as resp:
                await resp.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))


async def run(name: str, items: Sequence[Item], clients: int) -> tuple[float, list[int]]:
    async with SimCluster(3, base=SIM) as cluster:
        if name == "oracle":
            urls = cluster.urls
            await drive(lambda i: urls[i.key % 3], items, clients)
        else:
            cfg: dict[str, Any] = {
                "gateway": {"port": 0, "seed": 7, "access_log": False},
                "pool": {
                    "scrape_interval_s": 0.05,
                    "health": {"interval_s": 0.1, "timeout_s": 1.0},
                    "endpoints": [{"url": u} for u in cluster.urls],
                },
            }
            if PROFILES[name] is not None:
                cfg["picker"] = PROFILES[name]
            async with GatewayRunner(cfg) as gw:
                for _ in range(200):
                    if gw.gateway.pool.ready_count() == 3:
                        break
                    await asyncio.sleep(0.05)
                await drive(lambda _: gw.url, items, clients)
        engines = cluster.engines
        hits = sum(e.stats.prefix_cache_hits for e in engines)
        queries = sum(e.stats.prefix_cache_queries for e in engines)
        return hits / queries, [e.stats.requests_received for e in engines]


async def main_async(args: argparse.Namespace) -> None:
    names = ["oracle", *(args.profiles or PROFILES)]
    print("| workload | clients | profile | hit rate (per seed) | mean | of oracle | max/mean |")
    print("|---|---|---|---|---|---|---|")
    for name_w in args.workloads:
        for clients in args.clients:
            oracle_mean = 0.0
            for name in names:
                rates, worst = [], 0.0
                for seed in args.seeds:
                    items, _ = workload(name_w, seed, 1.0)
                    rate, per = await run(name, items, clients)
                    rates.append(rate)
                    worst = max(worst, max(per) / statistics.fmean(per))
                mean = statistics.fmean(rates)
                if name == "oracle":
                    oracle_mean = mean
                each = " / ".join(f"{r * 100:.1f}" for r in rates)
                print(
                    f"| {name_w} | {clients} | `{name}` | {each} | {mean * 100:.1f} % | "
                    f"{mean / oracle_mean:.2f} | ≤ {worst:.2f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workloads", nargs="+", default=["chat"])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--profiles", nargs="*", default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
