"""Cache-aware routing against real vLLM: the engines' own prefix-cache counters decide.

    .venv-engine/bin/python bench/bench_real_cache_routing.py            # seeds 0 1 2, ~3 min
    .venv-engine/bin/python bench/bench_real_cache_routing.py --requests 40 --seeds 5

Starts 2 real vLLM servers on CPU (`VllmCluster`, the engine tier's settings: the
tiny model, block 32, 128 KV blocks = 4,096 tokens each, KV events, dev mode for
`/reset_prefix_cache`). The workload: `groups` prefix groups, each a completion
prompt of a shared prefix (~850 tokens, 26 full blocks) plus a fresh ~40-token
question, groups drawn at random (seeded), sent one at a time. 8 groups × 26
blocks = 208 blocks: more than one server's 127 usable blocks, less than the
cluster's 254, so only routing that keeps each group on one server (4 groups a
server) can keep every prefix cached.

The same requests go through, in turn:

- `round-robin`: a gateway with `round-robin-picker`;
- `zero-config`: a gateway with only the endpoint URLs (what `servegate serve
  --endpoint …` gives: the default profile, `tokenizer: auto`, which finds the
  model folder through `/v1/models`; no KV events, as the servers share a host);
- `default`: a gateway with the default profile, the pool's `tokenizer: {source:
  hf}` pointed at the model folder and every endpoint's KV events (the precise
  index is fed by the servers themselves);
- `oracle`: no gateway; group g goes straight to server g mod 2.

Before each policy both servers' prefix caches are reset (vLLM answers
`{"success": bool}`; a refused reset is retried until it succeeds) and a fresh
gateway is started, so no policy inherits another's cache or index. The cluster
hit rate is Σ Δ`vllm:prefix_cache_hits_total` / Σ Δ`vllm:prefix_cache_queries_total`
over the servers, read after the counters have caught up with every prompt token;
requests per server come from Δ`vllm:request_success_total`.
`tests/engine/test_real_cache_routing.py` runs a smaller version and asserts on it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from servegate.bench.engine_counters import EngineCounters, scrape_counters
from servegate.bench.gateway_process import GatewayProcess
from servegate.bench.policies import picker_config
from servegate.testing.tinymodel import TinyModel, build_tiny_model
from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster

MODEL = "tiny"
POLICIES = ("round-robin", "zero-config", "default", "oracle")
WORDS = (
    "alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega",
    "river", "stone", "cloud", "field", "north", "south", "east", "west",
    "amber", "cobalt", "ivory", "slate", "copper", "silver", "garden", "harbor",
)  # fmt: skip
COUNTER_TIMEOUT_S = 30.0
RESET_ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class Spec:
    groups: int = 8
    requests: int = 160
    prefix_words: int = 290
    """About 2.9 tokens a word with the tiny model's tokenizer: ~850 tokens, 26 full blocks."""
    question_words: int = 12
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    group: int
    prompt: str


def workload(spec: Spec) -> list[Request]:
    """Groups drawn uniformly at random; every prompt = its group's prefix + a fresh question."""
    rng = random.Random(spec.seed)
    prefixes = [
        f"group {g} " + " ".join(rng.choice(WORDS) for _ in range(spec.prefix_words))
        for g in range(spec.groups)
    ]
    requests = []
    for index in range(spec.requests):
        group = rng.randrange(spec.groups)
        question = " ".join(rng.choice(WORDS) for _ in range(spec.question_words))
        requests.append(Request(group, f"{prefixes[group]} question {index}: {question}"))
    return requests


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    requests: int
    errors: int
    prefix_hits: float
    prefix_queries: float
    per_server: tuple[int, ...]
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Reset every server's prefix cache; vLLM refuses (`success: false`) while blocks are held."""
    for url in urls:
        last: Any = None
        for _ in range(RESET_ATTEMPTS):
            async with session.post(f"{url}/reset_prefix_cache") as response:
                raw = await response.read()
                last = (response.status, raw[:200])
                if response.status == 200 and raw and (await response.json()).get("success"):
                    break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache never succeeded; last answer {last}")


async def _counters(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[EngineCounters]:
    found = []
    for url in urls:
        counters = await scrape_counters(session, url)
        if counters is None or counters.prefix_queries is None or counters.prefix_hits is None:
            raise RuntimeError(f"{url}/metrics has no prefix-cache counters")
        found.append(counters)
    return found


def _delta(after: float | None, before: float | None) -> float:
    return (after or 0.0) - (before or 0.0)


async def run_policy(
    session: aiohttp.ClientSession,
    policy: str,
    target: Callable[[Request], str],
    requests: Sequence[Request],
    urls: Sequence[str],
) -> PolicyResult:
    """Send `requests` one at a time to `target(request)`; the engines' counters give the result."""
    before = await _counters(session, urls)
    started = time.perf_counter()
    errors = 0
    prompt_tokens = 0
    for request in requests:
        body = {"model": MODEL, "prompt": request.prompt, "max_tokens": 2, "temperature": 0}
        async with session.post(f"{target(request)}/v1/completions", json=body) as response:
            if response.status != 200:
                errors += 1
                continue
            prompt_tokens += int((await response.json())["usage"]["prompt_tokens"])
    wall_s = time.perf_counter() - started
    # the counters move with each engine's next stats record, not with the response
    deadline = time.monotonic() + COUNTER_TIMEOUT_S
    while True:
        pairs = list(zip(await _counters(session, urls), before, strict=True))
        queries = sum(_delta(a.prefix_queries, b.prefix_queries) for a, b in pairs)
        done = sum(_delta(a.requests, b.requests) for a, b in pairs)
        if queries >= prompt_tokens and done >= len(requests) - errors:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{policy}: engines counted {queries:.0f} of {prompt_tokens} prompt tokens"
            )
        await asyncio.sleep(0.2)
    return PolicyResult(
        policy=policy,
        requests=len(requests),
        errors=errors,
        prefix_hits=sum(_delta(a.prefix_hits, b.prefix_hits) for a, b in pairs),
        prefix_queries=queries,
        per_server=tuple(int(_delta(a.requests, b.requests)) for a, b in pairs),
        wall_s=wall_s,
    )


def gateway_config(policy: str, cluster: VllmCluster, model: TinyModel) -> dict[str, Any]:
    endpoints: list[dict[str, Any]] = []
    pool: dict[str, Any] = {"endpoints": endpoints, "scrape_interval_s": 0.1}
    config: dict[str, Any] = {
        "gateway": {"host": "127.0.0.1", "port": 0, "seed": 0},
        "pool": pool,
        "log_level": "info",
    }
    for server in cluster:
        endpoint: dict[str, Any] = {"url": server.url}
        if policy != "zero-config":
            endpoint["model"] = MODEL
        if policy == "default":
            endpoint["kv_events"] = server.kv_connect
        endpoints.append(endpoint)
    if policy == "round-robin":
        config["picker"] = picker_config((), "round-robin-picker")
    elif policy == "default":
        pool["tokenizer"] = {"source": "hf", "path": str(model.model_dir)}
    elif policy == "zero-config":
        del pool["scrape_interval_s"]
        del config["gateway"]["seed"]
    else:
        raise ValueError(f"no gateway for policy {policy!r}")
    return config


async def _kv_batches(session: aiohttp.ClientSession, gateway_url: str) -> dict[str, float]:
    async with session.get(f"{gateway_url}/metrics") as response:
        page = await response.text()
    found: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("servegate_kv_events_batches_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels] = float(value)
    return found


async def join_kv_events(
    session: aiohttp.ClientSession, gateway_url: str, cluster: VllmCluster
) -> None:
    """Prompts straight to each server until the gateway has applied a batch from every one.

    A ZeroMQ subscriber misses what was published before it connected; the caches
    are reset afterwards, so these prompts leave nothing behind.
    """
    for attempt in range(40):
        batches = await _kv_batches(session, gateway_url)
        if len(batches) == len(cluster) and all(v > 0 for v in batches.values()):
            return
        for server in cluster:
            body = {"model": MODEL, "prompt": f"join {attempt} " + "x " * 80, "max_tokens": 1}
            async with session.post(f"{server.url}/v1/completions", json=body) as response:
                await response.read()
        await asyncio.sleep(0.3)
    raise RuntimeError(f"the gateway never received KV events from every server: {batches}")


async def run_all(
    cluster: VllmCluster,
    model: TinyModel,
    spec: Spec,
    workdir: Path,
    policies: Sequence[str] = POLICIES,
) -> list[PolicyResult]:
    requests = workload(spec)
    urls = cluster.urls
    results = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for policy in policies:
            if policy == "oracle":
                await reset_prefix_caches(session, urls)
                results.append(
                    await run_policy(
                        session, policy, lambda r: urls[r.group % len(urls)], requests, urls
                    )
                )
                continue
            config = gateway_config(policy, cluster, model)
            async with GatewayProcess(policy, config, workdir, replicas=len(cluster)) as gateway:
                if policy == "default":
                    await join_kv_events(session, gateway.url, cluster)
                await reset_prefix_caches(session, urls)
                await asyncio.sleep(0.5)  # the reset's AllBlocksCleared reaches the index
                results.append(
                    await run_policy(session, policy, lambda _: gateway.url, requests, urls)
                )
    return results


def table(results: Sequence[PolicyResult]) -> str:
    oracle = next((r for r in results if r.policy == "oracle"), None)
    lines = [
        "| policy | requests | errors | cluster hit rate | of the oracle's | requests per server "
        "| wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = f"{r.hit_rate / oracle.hit_rate * 100:.0f} %" if oracle and oracle.hit_rate else "-"
        split = " / ".join(str(n) for n in r.per_server)
        lines.append(
            f"| `{r.policy}` | {r.requests} | {r.errors} | {r.hit_rate * 100:.1f} % "
            f"({r.prefix_hits:.0f} / {r.prefix_queries:.0f} tokens) | {share} | {split} "
            f"| {r.wall_s:.1f} s |"
        )
    return "\n".join(lines)


def summary(runs: Sequence[tuple[int, Sequence[PolicyResult]]]) -> str:
    """Hit rate per seed, the mean, and the mean as a share of the oracle's mean."""
    seeds = [seed for seed, _ in runs]
    names = [r.policy for r in runs[0][1]]
    mean = {
        name: statistics.fmean(r.hit_rate for _, rs in runs for r in rs if r.policy == name)
        for name in names
    }
    lines = [
        f"| policy | hit rate (seeds {' / '.join(map(str, seeds))}) | mean | of the oracle's "
        "| requests per server |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        rows = [r for _, rs in runs for r in rs if r.policy == name]
        rates = " / ".join(f"{r.hit_rate * 100:.1f}" for r in rows)
        split = ", ".join("/".join(str(n) for n in r.per_server) for r in rows)
        share = f"{mean[name] / mean['oracle'] * 100:.0f} %" if mean.get("oracle") else "-"
        lines.append(f"| `{name}` | {rates} | {mean[name] * 100:.1f} % | {share} | {split} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    defaults = Spec()
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args(argv)
    model = build_tiny_model()
    workdir = Path(tempfile.mkdtemp(prefix="servegate-real-routing-"))
    cluster = VllmCluster(model, ClusterSettings(replicas=args.replicas), workdir / "vllm")
    started = time.perf_counter()
    runs: list[tuple[int, list[PolicyResult]]] = []
    try:
        cluster.start()
        print(f"{args.replicas} vLLM servers healthy after {cluster.startup_s:.0f} s", flush=True)
        for seed in args.seeds:
            spec = Spec(groups=args.groups, requests=args.requests, seed=seed)
            results = asyncio.run(run_all(cluster, model, spec, workdir / f"gateways-{seed}"))
            print(f"\nseed {seed}:\n{table(results)}", flush=True)
            runs.append((seed, results))
    finally:
        cluster.stop()
    print(
        f"\n{args.groups} groups × ~{defaults.prefix_words * 29 // 10}-token prefix, "
        f"{args.requests} requests one at a time per seed; "
        f"{time.perf_counter() - started:.0f} s in all; logs under {workdir}\n"
    )
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
