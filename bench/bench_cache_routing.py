"""Cache-aware routing on a simulated cluster: hit rate, balance, a hot prefix (not a test).

    .venv/bin/python bench/bench_cache_routing.py                    # shared-prefix + hot prefix
    .venv/bin/python bench/bench_cache_routing.py --scenario shared --profiles default,exact
    .venv/bin/python bench/bench_cache_routing.py --micro           # tokenisation / ingest costs

Shared-prefix scenario: 4 simulated vLLM replicas (in this process, loopback and
ipc:// only) with a small KV cache each; `--groups` prefix groups whose prefixes
together fit the cluster's cache but not one replica's. Each request is a chat
with the group's system prompt and a fresh question, groups drawn uniformly,
sent by `--concurrency` closed-loop clients through a gateway running one
routing profile (a fresh cluster and gateway per profile, same requests). The
cluster prefix hit rate comes from the simulators' own counters (prompt tokens
hit / looked up); the imbalance is max/mean of requests per replica. ORACLE sends
each group straight to replica `group mod 4` (groups spread evenly), measured the
same way.

Hot-prefix scenario: one request per group first, one at a time (so each
prefix starts out cached on one replica), then one group carries `--hot-share`
of the traffic and the replicas have few sequence slots, so the replica holding
the hot prefix saturates. Counters are measured after the warm-up. Reported per replica: requests, the hot group's requests, and the
longest engine queue seen (sampled every 10 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml

from prefix_workload import (
    MODEL,
    Workload,
    body,
    drive,
    gateway_config,
    make_workload,
    sim_config,
    snapshot,
    totals,
    wait_ready,
    words,
)
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG
from servegate.simulator import tokenizer as sim_tokenizer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
LOAD = [("queue-scorer", 2), ("kv-cache-utilization-scorer", 2), ("active-request-scorer", 2)]


def picker(
    scorers: Sequence[tuple[str, float]],
    filters: Sequence[dict[str, Any]] = (),
    parameters: dict[str, dict[str, Any]] | None = None,
    picker_type: str = "max-score-picker",
) -> dict[str, Any]:
    params = parameters or {}
    plugins: list[dict[str, Any]] = list(filters)
    for t, _ in scorers:
        plugins.append({"type": t, "parameters": params[t]} if t in params else {"type": t})
    plugins.append({"type": picker_type})
    refs: list[dict[str, Any]] = [{"pluginRef": f.get("name", f["type"])} for f in filters]
    refs += [{"pluginRef": t, "weight": w} for t, w in scorers]
    refs.append({"pluginRef": picker_type})
    return {
        **HEAD,
        "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": refs}],
    }


@dataclass(frozen=True)
class Profile:
    name: str
    picker: dict[str, Any] | None
    """None: servegate's DEFAULT_PICKER_CONFIG."""
    tokenizer: bool = False
    kv_events: bool = False


AFFINITY = {"type": "prefix-cache-affinity-filter", "parameters": {"peakPrefillThroughput": 2000}}
CANDIDATE_A = [("precise-prefix-cache-scorer", 3), ("prefix-cache-scorer", 2), *LOAD]
CANDIDATE_E = [("precise-prefix-cache-scorer", 1), ("prefix-cache-scorer", 1), *LOAD]
CANDIDATE_H = [("precise-prefix-cache-scorer", 2), ("prefix-cache-scorer", 2), *LOAD]
CANDIDATE_I = [("precise-prefix-cache-scorer", 2), ("prefix-cache-scorer", 1), *LOAD]
CANDIDATE_B = [*CANDIDATE_A, ("no-hit-lru-scorer", 1)]
GUARD = {
    "type": "prefix-cache-affinity-filter",
    "parameters": {
        "maxInFlightRequestsDelta": 8,
        "prefixMatchInfoProducerName": "prefix-cache-scorer",
    },
}
STICKY = {
    "type": "prefix-cache-affinity-filter",
    "parameters": {"prefixMatchInfoProducerName": "prefix-cache-scorer"},
}
SATURATING = {
    "type": "prefix-cache-affinity-filter",
    "parameters": {
        "maxInFlightRequestsDelta": 3,
        "prefixMatchInfoProducerName": "prefix-cache-scorer",
    },
}
SATURATION = {"type": "utilization-detector", "parameters": {"metricsStalenessThreshold": "2s"}}
SPECULATIVE = {"precise-prefix-cache-scorer": {"speculativeIndexing": True}}
PROFILES = {
    p.name: p
    for p in [
        Profile("round-robin", picker([], picker_type="round-robin-picker")),
        Profile("load-only", picker(LOAD)),
        Profile("approx-chars", picker([("prefix-cache-scorer", 3), *LOAD])),
        Profile("approx-tokens", picker([("prefix-cache-scorer", 3), *LOAD]), tokenizer=True),
        Profile(
            "exact",
            picker([("precise-prefix-cache-scorer", 3), *LOAD]),
            tokenizer=True,
            kv_events=True,
        ),
        Profile(
            "exact-speculative",
            picker([("precise-prefix-cache-scorer", 3), *LOAD], parameters=SPECULATIVE),
            tokenizer=True,
            kv_events=True,
        ),
        Profile(
            "exact+approx",
            picker([("precise-prefix-cache-scorer", 3), ("prefix-cache-scorer", 2), *LOAD]),
            tokenizer=True,
            kv_events=True,
        ),
        Profile(
            "exact-affinity",
            picker([("precise-prefix-cache-scorer", 3), *LOAD], filters=[AFFINITY]),
            tokenizer=True,
            kv_events=True,
        ),
        Profile(
            "prefix-only",
            picker([("precise-prefix-cache-scorer", 1)]),
            tokenizer=True,
            kv_events=True,
        ),
        Profile("candidate-a-bare", picker(CANDIDATE_A)),
        Profile("candidate-a", picker(CANDIDATE_A), tokenizer=True, kv_events=True),
        Profile("candidate-b-bare", picker(CANDIDATE_B)),
        Profile("candidate-b", picker(CANDIDATE_B), tokenizer=True, kv_events=True),
        Profile("candidate-c-bare", picker(CANDIDATE_A, filters=[GUARD])),
        Profile(
            "candidate-c", picker(CANDIDATE_A, filters=[GUARD]), tokenizer=True, kv_events=True
        ),
        Profile("candidate-d-bare", picker(CANDIDATE_A, filters=[SATURATION])),
        Profile(
            "candidate-d", picker(CANDIDATE_A, filters=[SATURATION]), tokenizer=True, kv_events=True
        ),
        Profile("candidate-e-bare", picker(CANDIDATE_E, filters=[GUARD])),
        Profile(
            "candidate-e", picker(CANDIDATE_E, filters=[GUARD]), tokenizer=True, kv_events=True
        ),
        Profile("candidate-g-bare", picker(CANDIDATE_E, filters=[SATURATION, STICKY])),
        Profile(
            "candidate-g",
            picker(CANDIDATE_E, filters=[SATURATION, STICKY]),
            tokenizer=True,
            kv_events=True,
        ),
        Profile("candidate-h-bare", picker(CANDIDATE_H)),
        Profile("candidate-h", picker(CANDIDATE_H), tokenizer=True, kv_events=True),
        Profile("candidate-i-bare", picker(CANDIDATE_I)),
        Profile("candidate-i", picker(CANDIDATE_I), tokenizer=True, kv_events=True),
        Profile(
            "prefix-heavy-bare",
            picker([("precise-prefix-cache-scorer", 1), ("prefix-cache-scorer", 6), *LOAD]),
        ),
        Profile(
            "sticky-approx-bare", picker([("prefix-cache-scorer", 3), *LOAD], filters=[STICKY])
        ),
        Profile(
            "sticky-saturated-bare",
            picker(
                [("precise-prefix-cache-scorer", 1), ("prefix-cache-scorer", 3), *LOAD],
                filters=[SATURATING],
            ),
        ),
        Profile("default-bare", None),
        Profile("default", None, tokenizer=True, kv_events=True),
    ]
}


@dataclass
class Result:
    name: str
    hit_rate: float
    per_replica: list[int]
    hot_per_replica: list[int] = field(default_factory=list)
    peak_waiting: list[int] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    @property
    def imbalance(self) -> float:
        mean = statistics.fmean(self.per_replica)
        return max(self.per_replica) / mean if mean else 0.0


async def sample_queues(cluster: SimCluster, peaks: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for i, engine in enumerate(cluster.engines):
            peaks[i] = max(peaks[i], len(engine.waiting))
        await asyncio.sleep(0.01)


async def send_all(
    urls: Sequence[str],
    workload: Workload,
    concurrency: int,
    max_tokens: int,
    hot: list[int],
    served_by: dict[str, int],
) -> int:
    """Send every request; `urls` has one gateway URL, or one per replica (the oracle)."""

    def url_for(_: int, group: int) -> str:
        return urls[0] if len(urls) == 1 else urls[group % len(urls)]

    def on_ok(group: int, resp: aiohttp.ClientResponse) -> None:
        if group == 0:
            target = resp.headers.get("x-gateway-destination-endpoint") or ""
            hot.append(served_by.get(target, -1))

    return await drive(workload, concurrency, max_tokens, url_for, on_ok)


def replica_config(args: argparse.Namespace, hot: bool) -> dict[str, Any]:
    return sim_config(
        args.num_blocks,
        args.hot_speed if hot else args.speed,
        max_num_seqs=args.hot_max_seqs if hot else 64,
    )


def profile_config(cluster: SimCluster, profile: Profile) -> dict[str, Any]:
    endpoints = []
    for s in cluster:
        entry: dict[str, Any] = {"url": s.url}
        if profile.kv_events:
            entry["kv_events"] = s.kv_events_endpoint
        endpoints.append(entry)
    pool: dict[str, Any] = {"tokenizer": {"source": "simulator"}} if profile.tokenizer else {}
    cfg = gateway_config(endpoints, **pool)
    if profile.picker is not None:
        cfg["picker"] = profile.picker
    return cfg


async def warm_up(urls: Sequence[str], workload: Workload, max_tokens: int) -> None:
    """One request per group, one at a time: each prefix starts out on one replica."""
    async with aiohttp.ClientSession() as session:
        for group in range(len(workload.prefixes)):
            url = urls[0] if len(urls) == 1 else urls[group % len(urls)]
            payload = body(workload, group, "warm-up", max_tokens)
            async with session.post(url + "/v1/chat/completions", json=payload) as resp:
                await resp.read()
        await asyncio.sleep(0.3)


async def run(
    profile: Profile | None, workload: Workload, args: argparse.Namespace, hot: bool
) -> Result:
    started = time.monotonic()
    peaks = [0] * args.replicas
    hot_served: list[int] = []
    async with SimCluster(
        args.replicas, base=replica_config(args, hot), kv_events="ipc"
    ) as cluster:
        served_by = {s.address: i for i, s in enumerate(cluster)}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queues(cluster, peaks, stop))
        try:
            before = snapshot(cluster)
            if profile is None:
                errors = await send_all(
                    cluster.urls, workload, args.concurrency, args.max_tokens, [], served_by
                )
                hot_served = [r[0] % args.replicas for r in workload.requests if r[0] == 0]
            else:
                async with GatewayRunner(profile_config(cluster, profile)) as gw:
                    await wait_ready(gw, args.replicas)
                    manager = gw.gateway.cache_routing.kv_events
                    if manager is not None:
                        await manager.wait_ready()
                        await asyncio.sleep(0.2)  # let the subscriptions reach the publishers
                    if hot:
                        await warm_up([gw.url], workload, args.max_tokens)
                        before = snapshot(cluster)
                    errors = await send_all(
                        [gw.url], workload, args.concurrency, args.max_tokens, hot_served, served_by
                    )
        finally:
            stop.set()
            await sampler
        rate, per_replica = totals(cluster, before)
    hot_counts = [hot_served.count(i) for i in range(args.replicas)]
    return Result(
        profile.name if profile else "ORACLE",
        rate,
        per_replica,
        hot_counts,
        peaks,
        errors,
        time.monotonic() - started,
    )


def print_table(title: str, results: list[Result], oracle: Result | None, hot: bool) -> None:
    print(f"\n## {title}\n")
    cols = "| profile | hit rate | of oracle | requests per replica | max/mean |"
    line = "|---|---|---|---|---|"
    if hot:
        cols += " hot group per replica | peak queue per replica |"
        line += "---|---|"
    print(cols + " errors | wall |")
    print(line + "---|---|")
    for r in results:
        share = f"{100 * r.hit_rate / oracle.hit_rate:.1f} %" if oracle and oracle.hit_rate else "-"
        row = (
            f"| {r.name} | {100 * r.hit_rate:.1f} % | {share} | "
            f"{' / '.join(map(str, r.per_replica))} | {r.imbalance:.2f} |"
        )
        if hot:
            row += (
                f" {' / '.join(map(str, r.hot_per_replica))} |"
                f" {' / '.join(map(str, r.peak_waiting))} |"
            )
        print(row + f" {r.errors} | {r.wall_s:.1f} s |")


async def scenario(args: argparse.Namespace, hot: bool) -> None:
    names = args.profiles.split(",") if args.profiles else None
    if hot:
        names = names or [
            "load-only",
            "prefix-only",
            "exact",
            "exact+approx",
            "exact-affinity",
            "candidate-e",
            "candidate-g",
            "candidate-h",
            "default-bare",
            "default",
        ]
        workload = make_workload(
            args.groups, args.prefix_words, args.hot_requests, args.hot_share, args.seed
        )
    else:
        names = names or [
            "round-robin",
            "load-only",
            "approx-chars",
            "approx-tokens",
            "exact",
            "exact-speculative",
            "exact+approx",
            "exact-affinity",
            "candidate-e",
            "candidate-g",
            "candidate-h",
            "default-bare",
            "default",
        ]
        workload = make_workload(args.groups, args.prefix_words, args.requests, None, args.seed)
    oracle = None if hot else await run(None, workload, args, hot)
    results = [await run(PROFILES[n], workload, args, hot) for n in names]
    title = (
        f"hot prefix: group 0 carries {args.hot_share:.0%} of {args.hot_requests} requests"
        if hot
        else f"shared prefix: {args.groups} groups x ~{args.prefix_words} tokens, "
        f"{args.requests} requests"
    )
    print_table(title, ([oracle] if oracle else []) + results, oracle, hot)


# -- microbenchmarks ---------------------------------------------------------------------------


def per_call_us(fn: Any, n: int) -> float:
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


async def micro(args: argparse.Namespace) -> None:
    from servegate.datalayer.kvevents import decode_batch
    from servegate.scheduling.prefix.precise import PreciseIndex
    from servegate.scheduling.request import LLMRequest, RequestKind
    from servegate.simulator import kv_cache
    from servegate.simulator.kv_events import encode_batch
    from servegate.tokenization.routing import RoutingTokenizers
    from servegate.tokenization.settings import TokenizerSettings
    from servegate.tokenization.sources import HFTokenizer

    rng = random.Random(1)
    text = words(rng, 2000)
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "why?"}]
    n_tokens = len(sim_tokenizer.encode_chat(messages))
    print(f"\n## microbenchmarks (chat of {n_tokens} simulator tokens)\n")
    print("| what | per call |")
    print("|---|---|")

    def chat_request() -> LLMRequest:
        return LLMRequest(
            "r",
            RequestKind.CHAT,
            MODEL,
            MODEL,
            MODEL,
            messages=messages,
            body={"model": MODEL, "messages": messages},
        )

    sim_tok = RoutingTokenizers(TokenizerSettings(source="simulator"))
    prepared = []
    for _ in range(50):
        t0 = time.perf_counter()
        await sim_tok.prepare(chat_request(), [])
        prepared.append((time.perf_counter() - t0) * 1e6)
    sim_only = per_call_us(lambda: sim_tokenizer.encode_chat(messages), 50)
    print(f"| simulator tokenizer, chat → ids | {sim_only:.0f} µs |")
    print(f"| the same through RoutingTokenizers.prepare | {statistics.median(prepared):.0f} µs |")
    if args.hf:
        hf = HFTokenizer(args.hf)
        print(
            f"| HF tokenizer {args.hf}, chat template + encode | "
            f"{per_call_us(lambda: hf.chat_ids(messages, {}), 50):.0f} µs |"
        )
    async with SimCluster(1, base={"model": MODEL}) as cluster:
        from servegate.pool.endpoint import Endpoint, EndpointState

        ep = EndpointState(Endpoint(address=cluster[0].address, url=cluster[0].url))
        engine = RoutingTokenizers(TokenizerSettings(source="engine", cache_size=0))
        cached = RoutingTokenizers(TokenizerSettings(source="engine"))
        async with aiohttp.ClientSession() as session:
            engine.bind_session(session)
            cached.bind_session(session)
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                await engine.prepare(chat_request(), [ep])
                times.append((time.perf_counter() - t0) * 1e6)
            await cached.prepare(chat_request(), [ep])
            hits = []
            for _ in range(200):
                t0 = time.perf_counter()
                await cached.prepare(chat_request(), [ep])
                hits.append((time.perf_counter() - t0) * 1e6)
    print(
        f"| engine /tokenize over loopback (simulator), uncached | "
        f"{statistics.median(times):.0f} µs |"
    )
    print(f"| engine /tokenize, body-hash cache hit | {statistics.median(hits):.0f} µs |")

    # KV-event ingest: decode + index apply, vLLM-like batches of one BlockStored of 1 block
    # (a decode step completing a block) or of 8 blocks (a prefill), map encoding.
    for blocks in (1, 8):
        payloads = []
        parent = None
        for i in range(2000):
            hashes = [i * 16 + j for j in range(blocks)]
            event = kv_cache.BlockStored(
                hashes,
                parent,
                [rng.randrange(50000) for _ in range(16 * blocks)],
                16,
                None,
                "GPU",
                None,
            )
            parent = hashes[-1]
            payloads.append(encode_batch([event], 0.0, "map"))
        index = PreciseIndex(max_blocks_per_endpoint=1_000_000)
        t0 = time.perf_counter()
        for p in payloads:
            index.apply("a", decode_batch(p))
        elapsed = time.perf_counter() - t0
        rate = len(payloads) * blocks / elapsed
        print(
            f"| KV ingest, BlockStored of {blocks} block(s) per batch | "
            f"{elapsed / len(payloads) * 1e6:.1f} µs per batch, {rate:,.0f} blocks/s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["shared", "hot", "all"], default="all")
    parser.add_argument("--profiles", default="", help="comma-separated; default: all of them")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=600)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=240, help="KV blocks per replica")
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--hot-share", type=float, default=0.8)
    parser.add_argument("--hot-requests", type=int, default=480)
    parser.add_argument("--hot-max-seqs", type=int, default=4)
    parser.add_argument("--hot-speed", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--micro", action="store_true", help="only the microbenchmarks")
    parser.add_argument("--hf", default=None, help="a HuggingFace tokenizer folder for --micro")
    args = parser.parse_args()
    print(f"# bench_cache_routing — Python {platform.python_version()}, {sys.platform}")
    print("command: " + " ".join(["python", *sys.argv]))
    if args.micro:
        asyncio.run(micro(args))
        return
    cache_tokens = (args.num_blocks - 1) * 16
    print(
        f"\n{args.replicas} replicas x {cache_tokens} tokens of KV cache; default profile:\n"
        + yaml.safe_dump(yaml.safe_load(DEFAULT_PICKER_CONFIG)["schedulingProfiles"])
    )
    if args.scenario in ("shared", "all"):
        asyncio.run(scenario(args, hot=False))
    if args.scenario in ("hot", "all"):
        asyncio.run(scenario(args, hot=True))


if __name__ == "__main__":
    main()
