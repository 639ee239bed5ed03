"""servegate with nothing configured against vllm-router and sglang-router, on real vLLM.

    flock /tmp/servegate-vllm.lock .venv-engine/bin/python bench/bench_real_peers.py \\
        --peers .venv-peers/bin --workloads shared chat

Starts `--replicas` real vLLM servers on CPU (`VllmCluster`: the tiny model, block
32, 128 KV blocks = 4,096 tokens each, dev mode for `/reset_prefix_cache`) and sends
the same requests, one workload at a time, through:

- `round-robin`: servegate with `round-robin-picker`;
- `servegate`: `servegate serve` with only the endpoint URLs (what `--endpoint A
  --endpoint B --endpoint C` gives: the default profile, `tokenizer: auto`, no
  KV-event settings);
- `vllm-router`: `vllm-router --policy cache_aware --worker-urls …` (PyPI
  `vllm-router`, its defaults otherwise);
- `sglang-router`: `sglang-router launch --policy cache_aware --worker-urls …`
  (PyPI `sglang-router`, its defaults otherwise);
- `oracle`: no router; key k (prefix group or conversation) straight to server k mod N.

Before each target every server's prefix cache is reset. The cluster hit rate is
Σ Δ`vllm:prefix_cache_hits_total` / Σ Δ`vllm:prefix_cache_queries_total`; balance is
max/mean of Δ`vllm:request_success_total` per server.

Workloads (all seeded; `--scale` multiplies request counts):

- `shared`: completions; `groups` prefixes of ~1,100 tokens (34 blocks) + a fresh
  question each; 9 groups = 306 blocks fit the cluster's 381 usable blocks, not one
  server's 127;
- `shared-c4`: the same with 4 concurrent clients;
- `shared-many`: 15 groups of ~650 tokens (20 blocks = 300): more, shorter prefixes;
- `chat`: multi-turn chats, each with its own ~500-token system prompt; 8
  conversations active at a time, each of 6 turns (user ~70 tokens, a fixed
  assistant reply ~35 tokens), a finished one replaced by a new one, the next turn
  drawn among the active ones; 30 conversations ≈ 34k tokens in all, ≈ 2.8× the
  cluster's KV cache; the active ones ≈ 6k tokens: fits the cluster, not one server;
- `chat-c4`: the same with 4 concurrent clients;
- `shared-c8`, `chat-c8`: the same with 8 concurrent clients;
- `chat-heavy`: 12 conversations active (≈ 9k tokens: three quarters of the cluster's
  cache), 36 in all, 8 concurrent clients.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench_real_cache_routing import WORDS, _counters, _delta, reset_prefix_caches
from peer_routers import peer_router
from servegate.bench.gateway_process import GatewayProcess
from servegate.bench.policies import picker_config
from servegate.testing.tinymodel import build_tiny_model
from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster

MODEL = "tiny"
TARGETS = ("round-robin", "servegate", "vllm-router", "sglang-router", "oracle")
COUNTER_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Item:
    key: int
    """Prefix group or conversation: the oracle sends key k to server k mod N."""
    path: str
    body: dict[str, Any]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_workload(
    groups: int, prefix_words: int, requests: int, seed: int, tag: str = ""
) -> list[Item]:
    rng = random.Random(seed)
    prefixes = [f"group {g}{tag} " + _words(rng, prefix_words) for g in range(groups)]
    out = []
    for i in range(requests):
        g = rng.randrange(groups)
        prompt = f"{prefixes[g]} question {i}: {_words(rng, 12)}"
        out.append(Item(g, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}))
    return out


def chat_workload(
    conversations: int, active: int, turns: int, system_words: int, seed: int
) -> list[Item]:
    rng = random.Random(seed)
    systems = [f"conversation {c}. " + _words(rng, system_words) for c in range(conversations)]
    history: dict[int, list[dict[str, str]]] = {}
    done: dict[int, int] = {}
    live: list[int] = []
    next_conv = 0
    out = []
    while live or next_conv < conversations:
        while len(live) < active and next_conv < conversations:
            live.append(next_conv)
            history[next_conv] = [{"role": "system", "content": systems[next_conv]}]
            done[next_conv] = 0
            next_conv += 1
        c = rng.choice(live)
        messages = history[c]
        messages.append({"role": "user", "content": f"turn {done[c]}: " + _words(rng, 24)})
        out.append(
            Item(
                c,
                "/v1/chat/completions",
                {"model": MODEL, "messages": list(messages), "max_tokens": 2, "temperature": 0},
            )
        )
        messages.append({"role": "assistant", "content": _words(rng, 12)})
        done[c] += 1
        if done[c] >= turns:
            live.remove(c)
    return out


def workload(name: str, seed: int, scale: float) -> tuple[list[Item], int]:
    """(items, concurrency)."""
    if name == "shared":
        return shared_workload(9, 380, int(120 * scale), seed), 1
    if name == "shared-c4":
        return shared_workload(9, 380, int(120 * scale), seed), 4
    if name == "shared-many":
        return shared_workload(15, 225, int(150 * scale), seed, tag="m"), 1
    if name == "chat":
        return chat_workload(int(30 * scale), 8, 6, 170, seed), 1
    if name == "chat-c4":
        return chat_workload(int(30 * scale), 8, 6, 170, seed), 4
    if name == "shared-c8":
        return shared_workload(9, 380, int(120 * scale), seed), 8
    if name == "chat-c8":
        return chat_workload(int(30 * scale), 8, 6, 170, seed), 8
    if name == "chat-heavy":
        return chat_workload(int(36 * scale), 12, 6, 170, seed), 8
    raise ValueError(f"unknown workload {name!r}")


@dataclass(frozen=True, slots=True)
class Result:
    workload: str
    target: str
    requests: int
    errors: int
    hits: float
    queries: float
    per_server: tuple[int, ...]
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def imbalance(self) -> float:
        mean = statistics.fmean(self.per_server) if self.per_server else 0.0
        return max(self.per_server) / mean if mean else 0.0


async def drive(
    session: aiohttp.ClientSession,
    items: Sequence[Item],
    url_for: Callable[[Item], str],
    concurrency: int,
) -> tuple[int, int]:
    """Send every item, `concurrency` at a time in order; (errors, prompt tokens answered)."""
    queue = list(reversed(items))
    errors = 0
    prompt_tokens = 0

    async def client() -> None:
        nonlocal errors, prompt_tokens
        while queue:
            item = queue.pop()
            try:
                async with session.post(url_for(item) + item.path, json=item.body) as resp:
                    raw = await resp.json(content_type=None)
                    if resp.status != 200:
                        errors += 1
                        continue
                    prompt_tokens += int(raw["usage"]["prompt_tokens"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                errors += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return errors, prompt_tokens


async def measure(
    session: aiohttp.ClientSession,
    name: str,
    target: str,
    items: Sequence[Item],
    url_for: Callable[[Item], str],
    urls: Sequence[str],
    concurrency: int,
) -> Result:
    before = await _counters(session, urls)
    started = time.perf_counter()
    errors, prompt_tokens = await drive(session, items, url_for, concurrency)
    wall = time.perf_counter() - started
    deadline = time.monotonic() + COUNTER_TIMEOUT_S
    while True:
        pairs = list(zip(await _counters(session, urls), before, strict=True))
        queries = sum(_delta(a.prefix_queries, b.prefix_queries) for a, b in pairs)
        finished = sum(_delta(a.requests, b.requests) for a, b in pairs)
        if queries >= prompt_tokens and finished >= len(items) - errors:
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return Result(
        name,
        target,
        len(items),
        errors,
        sum(_delta(a.prefix_hits, b.prefix_hits) for a, b in pairs),
        queries,
        tuple(int(_delta(a.requests, b.requests)) for a, b in pairs),
        wall,
    )


STICKY_SATURATED: dict[str, Any] = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {
            "type": "prefix-cache-affinity-filter",
            "parameters": {
                "maxInFlightRequestsDelta": 3,
                "prefixMatchInfoProducerName": "prefix-cache-scorer",
            },
        },
        {"type": "precise-prefix-cache-scorer"},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "active-request-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-affinity-filter"},
                {"pluginRef": "precise-prefix-cache-scorer", "weight": 1},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "active-request-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
"""`servegate-sticky`: the default's scorers before 2026-12-02 behind an affinity filter
that keeps the replicas holding the prefix until one holds 3 more requests in flight
than the least loaded (the candidate that became the default, with `no-hit-lru-scorer`
added; cache-routing.md)."""


def servegate_config(target: str, urls: Sequence[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "gateway": {"host": "127.0.0.1", "port": 0},
        "pool": {"endpoints": [{"url": u} for u in urls]},
    }
    if target == "round-robin":
        config["picker"] = picker_config((), "round-robin-picker")
    elif target == "servegate-sticky":
        config["picker"] = STICKY_SATURATED
    return config


async def run_target(
    session: aiohttp.ClientSession,
    target: str,
    name: str,
    items: Sequence[Item],
    concurrency: int,
    urls: Sequence[str],
    peers: Path | None,
    workdir: Path,
) -> Result | None:
    await reset_prefix_caches(session, urls)
    if target == "oracle":
        return await measure(
            session, name, target, items, lambda i: urls[i.key % len(urls)], urls, concurrency
        )
    if target in ("vllm-router", "sglang-router"):
        if peers is None:
            return None
        async with peer_router(target, peers, urls, workdir, MODEL) as url:
            await reset_prefix_caches(session, urls)
            return await measure(session, name, target, items, lambda _: url, urls, concurrency)
    config = servegate_config(target, urls)
    tag = name.replace("/", "-")
    async with GatewayProcess(
        f"{tag}-{target}", config, workdir, replicas=len(urls), startup_timeout_s=180.0
    ) as gw:
        await reset_prefix_caches(session, urls)
        return await measure(session, name, target, items, lambda _: gw.url, urls, concurrency)


def table(results: Sequence[Result]) -> str:
    lines = [
        "| workload | target | hit rate | of oracle | requests per server | max/mean | errors "
        "| wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    oracle = {r.workload: r.hit_rate for r in results if r.target == "oracle"}
    for r in results:
        o = oracle.get(r.workload)
        share = f"{r.hit_rate / o:.2f}" if o else "-"
        lines.append(
            f"| {r.workload} | `{r.target}` | {r.hit_rate * 100:.1f} % | {share} "
            f"| {' / '.join(map(str, r.per_server))} | {r.imbalance:.2f} | {r.errors} "
            f"| {r.wall_s:.0f} s |"
        )
    return "\n".join(lines)


async def run_all(
    urls: Sequence[str],
    workloads: Sequence[str],
    targets: Sequence[str],
    seed: int,
    scale: float,
    peers: Path | None,
    workdir: Path,
) -> list[Result]:
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for name in workloads:
            items, concurrency = workload(name, seed, scale)
            label = f"{name}/s{seed}"
            for target in targets:
                result = await run_target(
                    session, target, label, items, concurrency, urls, peers, workdir
                )
                if result is not None:
                    results.append(result)
                    print(table([result]).splitlines()[-1], flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["shared", "chat"])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--blocks", type=int, default=128, help="KV blocks of 32 per server")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--peers", type=Path, default=None, help="folder with the peer routers")
    args = parser.parse_args(argv)
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so the vLLM servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = build_tiny_model()
    workdir = Path(tempfile.mkdtemp(prefix="servegate-peers-"))
    settings = ClusterSettings(replicas=args.replicas, num_blocks=args.blocks)
    cluster = VllmCluster(model, settings, workdir / "vllm")
    started = time.perf_counter()
    tables = []
    try:
        cluster.start()
        print(f"{args.replicas} vLLM servers healthy after {cluster.startup_s:.0f} s", flush=True)
        for seed in args.seeds:
            print(f"seed {seed}", flush=True)
            results = asyncio.run(
                run_all(
                    cluster.urls, args.workloads, args.targets, seed, args.scale, args.peers,
                    workdir,
                )
            )  # fmt: skip
            tables.append((seed, table(results)))
    finally:
        cluster.stop()
    print(f"\n{time.perf_counter() - started:.0f} s in all; {args.blocks} blocks per server; ")
    print(f"logs in {workdir}")
    for seed, text in tables:
        print(f"\nseed {seed}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
