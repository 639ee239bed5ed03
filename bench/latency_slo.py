"""SLO-aware routing against the default profile on simulated vLLM replicas (not a test).

    .venv/bin/python bench/latency_slo.py --plot docs/img/latency-slo.png   # documented run
    .venv/bin/python bench/latency_slo.py --requests 200 --policy default --policy slo
    .venv/bin/python bench/latency_slo.py --slow-factor 1 --policy default --policy slo
    .venv/bin/python bench/latency_slo.py --policy default --policy slo \
        --policy vllm-router --policy sglang-router   # the peers, from --peers
    .venv/bin/python bench/latency_slo.py --policy slo --trace /tmp/slo-trace.jsonl
    .venv/bin/python bench/latency_replay.py /tmp/slo-trace.jsonl   # the predictor, offline
    flock /tmp/servegate-vllm.lock .venv-engine/bin/python bench/latency_slo.py --vllm 3 \
        --policy default --policy slo --doc-words 300 --requests 60 --rate-start 0.15 \
        --rate-end 0.8 --chat-ttft-ms 3000 --chat-tpot-ms 300 --rag-ttft-ms 10000 \
        --rag-tpot-ms 500                        # real vLLM on CPU (docs/benchmarks.md)

The same requests at the same arrival times, each policy behind its own in-process
gateway over its own fresh simulated replicas (one child process each), all policies
at once (so that they share whatever else the machine is doing; `--sequential` runs
them one after the other). Workload (seeded):

- interactive chats (`--chat-share`): one of a few shared system prompts (~250
  words) + a short question, 48 output tokens, objective `interactive` (priority 0),
  SLO `x-llm-d-slo-ttft-ms: --chat-ttft-ms`, `x-llm-d-slo-tpot-ms: --chat-tpot-ms`;
- long-prompt RAG: one of `--documents` documents (~`--doc-words` words, so
  documents recur: shared prefixes) + a question, 96 output tokens, objective
  `batch` (priority −1: sheddable), looser SLO;
- arrivals Poisson with the rate rising linearly from `--rate-start` to
  `--rate-end` requests/s (past the replicas' capacity at the end);
- replicas: `--replicas` simulators at `--speed` (slow: the machine these numbers were
  taken on is shared), one of them `--slow-factor` times as fast (an older GPU in the
  pool; 1 = a homogeneous pool); or, with `--vllm N`, N real vLLM servers on CPU
  (`VllmCluster`, the tiny model of shared/REAL_VLLM.md) shared by the policies, which
  then run one after the other, every prefix cache reset before each.

`vllm-router` and `sglang-router` are the peer routers (`--peers`: the folder holding
their executables, `.venv-peers/bin` of the repository by default) started in front of
their own replicas the same way with their `cache_aware` policy (`peer_routers.py`,
shared with `bench_real_peers.py`); they ignore the SLO and objective headers, shed
nothing, and have no predictor.

Reported per policy: SLO attainment per class (a request attains its SLO when it
completed with TTFT and mean inter-token time within both objectives; a shed
request does not), goodput (requests/s that attained), p50/p99 TTFT per class (served
requests, client side), requests shed (429; in parentheses those latency-slo-admitter
shed, the rest being flow control's), prompt tokens cached (from the answers' usage;
on real vLLM, which then runs with `--enable-prompt-tokens-details`, also the engines'
own prefix-cache counters), and the predictor's MAPE on this run's completed streams
(engine-side TTFT and TPOT against what it predicted at dispatch, from the access log;
the predictor learns under every servegate policy; n/a for a peer). On real vLLM a
second table puts vLLM's own mean TTFT (its `vllm:time_to_first_token_seconds`
histogram) beside the client's: the time spent outside the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from peer_routers import PEERS, missing_peers, peer_router
from servegate.bench.client import RequestResult, send_request
from servegate.bench.stats import percentile
from servegate.bench.text import words
from servegate.bench.workloads import BenchRequest
from servegate.scheduling.latency.predictor import MIN_LEARNED_MS
from servegate.testing.cluster import SimClusterProcess
from servegate.testing.gateway import GatewayRunner

REPO = Path(__file__).resolve().parent.parent
MODEL = "sim-model"
VLLM_MODEL = "tiny"
HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
SLO_MOST = {
    **HEAD,
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
        {"type": "slo-headroom-tier-filter"},
        {
            "type": "latency-scorer",
            "parameters": {"headroomSelectionStrategy": "most"},
        },
        {"type": "latency-slo-admitter"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "predicted-latency-producer"},
                {"pluginRef": "slo-headroom-tier-filter"},
                {"pluginRef": "latency-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
SLO_LEAST = {
    **HEAD,
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
        {"type": "slo-headroom-tier-filter"},
        {"type": "latency-scorer"},
        {"type": "latency-slo-admitter"},
        {"type": "weighted-random-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "predicted-latency-producer"},
                {"pluginRef": "slo-headroom-tier-filter"},
                {"pluginRef": "latency-scorer", "weight": 1},
                {"pluginRef": "weighted-random-picker"},
            ],
        }
    ],
}
SLO_PREFIX = {
    **SLO_MOST,
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "predicted-latency-producer"},
                {"pluginRef": "slo-headroom-tier-filter"},
                {"pluginRef": "latency-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
LOAD_ONLY = {
    **HEAD,
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "active-request-scorer"},
    ],
}
ROUND_ROBIN = {**HEAD, "plugins": [{"type": "round-robin-picker"}]}
POLICIES: dict[str, dict[str, Any] | None] = {
    "round-robin": ROUND_ROBIN,
    "load-only": LOAD_ONLY,
    "default": None,
    "slo-least": SLO_LEAST,
    "slo": SLO_MOST,
    "slo-prefix": SLO_PREFIX,
}
DEFAULT_POLICIES = ("round-robin", "default", "slo-least", "slo")
"""`default` is servegate's default picker config; `slo` the SLO profile of
docs/latency-routing.md; `slo-least` llm-d's shipped shape (`least`, weighted random)."""


@dataclass(frozen=True)
class Item:
    request: BenchRequest
    cls: str
    ttft_slo_s: float
    tpot_slo_s: float
    at: float


@dataclass(frozen=True)
class Front:
    """Where one policy's traffic goes, and the access log its predictor's error is read
    from (a peer keeps none)."""

    url: str
    access: Callable[[], list[dict[str, Any]]]


@dataclass(frozen=True)
class Row:
    policy: str
    items: list[Item]
    results: list[RequestResult]
    wall_s: float
    access: list[dict[str, Any]]
    engine_hit_rate: float | None = None
    """Real vLLM: Σ Δ`vllm:prefix_cache_hits_total` / Σ Δ`prefix_cache_queries_total`
    over the servers during this policy's run (the engine's own count)."""
    engine_ttft_s: float | None = None
    """Real vLLM: the mean of its own TTFT histogram over this policy's run."""


def workload(args: argparse.Namespace) -> list[Item]:
    rng = random.Random(args.seed)
    systems = [f"System prompt {i}. " + words(rng, 250) for i in range(4)]
    docs = [f"Document {i}. " + words(rng, args.doc_words) for i in range(args.documents)]
    items = []
    t = 0.0
    duration = args.requests / ((args.rate_start + args.rate_end) / 2)
    for i in range(args.requests):
        rate = args.rate_start + (args.rate_end - args.rate_start) * min(1.0, t / duration)
        t += rng.expovariate(rate)
        if rng.random() < args.chat_share:
            prompt = rng.choice(systems) + f"\nUser {i}: " + words(rng, 25) + "?"
            headers = {
                "x-llm-d-inference-objective": "interactive",
                "x-llm-d-slo-ttft-ms": str(args.chat_ttft_ms),
                "x-llm-d-slo-tpot-ms": str(args.chat_tpot_ms),
            }
            req = BenchRequest(model=args.model, max_tokens=48, prompt=prompt, headers=headers)
            items.append(Item(req, "chat", args.chat_ttft_ms / 1e3, args.chat_tpot_ms / 1e3, t))
        else:
            prompt = rng.choice(docs) + f"\nQuestion {i}: " + words(rng, 20) + "?"
            headers = {
                "x-llm-d-inference-objective": "batch",
                "x-llm-d-slo-ttft-ms": str(args.rag_ttft_ms),
                "x-llm-d-slo-tpot-ms": str(args.rag_tpot_ms),
            }
            req = BenchRequest(model=args.model, max_tokens=96, prompt=prompt, headers=headers)
            items.append(Item(req, "rag", args.rag_ttft_ms / 1e3, args.rag_tpot_ms / 1e3, t))
    return items


def attained(item: Item, result: RequestResult) -> bool:
    if not result.ok or result.ttft_s is None:
        return False
    tpot = sum(result.itl_s) / len(result.itl_s) if result.itl_s else 0.0
    return result.ttft_s <= item.ttft_slo_s and tpot <= item.tpot_slo_s


async def start_policy(
    name: str, args: argparse.Namespace, stack: contextlib.AsyncExitStack
) -> Front:
    """Fresh simulated replicas and, in front of them, a gateway with policy `name` or
    the peer router `name`, ready to serve."""
    sim = {
        "model": MODEL,
        "speed": args.speed,
        "num_blocks": 4097,
        "block_size": 16,
        "max_model_len": 8192,
    }
    urls: list[str] = args.urls
    if not urls:
        overrides = None
        if args.slow_factor != 1.0:
            overrides = [{"speed": args.speed * args.slow_factor}] + [{}] * (args.replicas - 1)
        sims = await stack.enter_async_context(
            SimClusterProcess(args.replicas, base=sim, overrides=overrides, startup_timeout=180)
        )
        urls = sims.urls
    if name in PEERS:
        workdir = Path(tempfile.mkdtemp(prefix=f"servegate-slo-{name}-"))
        url = await stack.enter_async_context(
            peer_router(name, args.peers, urls, workdir, args.model)
        )
        return Front(url, list)
    cfg: dict[str, Any] = {
        "gateway": {"seed": args.seed, "port": 0},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.5, "timeout_s": 5.0},
            "endpoints": [{"url": url} for url in urls],
        },
        "flow_control": {
            "objectives": [
                {"name": "interactive", "priority": 0},
                {"name": "batch", "priority": -1},
            ]
        },
    }
    picker = POLICIES[name]
    if picker is not None:
        cfg["picker"] = picker
    gw = await stack.enter_async_context(GatewayRunner(cfg))
    pool = gw.gateway.pool
    deadline = time.monotonic() + 120
    while pool.ready_count() < len(urls) or pool.resolve_model(args.model) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the simulated replicas did not become ready")
        await asyncio.sleep(0.05)
    return Front(gw.url, gw.access_lines)


async def drive(name: str, front: Front, items: list[Item], http: aiohttp.ClientSession) -> Row:
    start = time.perf_counter()

    async def one(item: Item) -> RequestResult:
        await asyncio.sleep(max(0.0, start + item.at - time.perf_counter()))
        return await send_request(http, front.url, item.request, stream=True, ignore_eos=True)

    results = await asyncio.gather(*(one(i) for i in items))
    wall = time.perf_counter() - start
    return Row(name, items, list(results), wall, front.access())


async def run_policies(names: list[str], items: list[Item], args: argparse.Namespace) -> list[Row]:
    """Every policy at once, all started before the first request; or one after another."""
    rows: list[Row] = []
    groups = [[n] for n in names] if args.sequential else [names]
    for group in groups:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            )
            if args.urls:
                from bench_real_cache_routing import reset_prefix_caches

                await reset_prefix_caches(http, args.urls)
            fronts = [await start_policy(n, args, stack) for n in group]
            before = await engine_counters(http, args.urls)
            done = await asyncio.gather(
                *(drive(n, f, items, http) for n, f in zip(group, fronts, strict=True))
            )
            if before is not None and len(done) == 1:
                after = await engine_counters(http, args.urls)
                if after is not None and after[1] > before[1] and after[3] > before[3]:
                    rate = (after[0] - before[0]) / (after[1] - before[1])
                    ttft = (after[2] - before[2]) / (after[3] - before[3])
                    done = [dataclasses.replace(done[0], engine_hit_rate=rate, engine_ttft_s=ttft)]
            rows.extend(done)
            for row in done:
                print(table([row]).splitlines()[-1], flush=True)
    return rows


async def engine_counters(
    http: aiohttp.ClientSession, urls: list[str]
) -> tuple[float, float, float, float] | None:
    """Real vLLM's prefix-cache hits and queries (tokens) and its own TTFT histogram's sum
    (s) and count, summed over the servers; None for simulators or when a server does not
    export them."""
    if not urls:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    wanted = (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    )
    sums = dict.fromkeys(wanted, 0.0)
    seen: set[str] = set()
    for url in urls:
        try:
            async with http.get(url.rstrip("/") + "/metrics") as response:
                page = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
                    seen.add(sample.name)
    if len(seen) < len(wanted):
        return None
    hits, queries, ttft_sum, ttft_count = (sums[name] for name in wanted)
    return hits, queries, ttft_sum, ttft_count


def engine_table(rows: list[Row]) -> str:
    """Real vLLM: the engines' own view beside the client's, per policy. vLLM's TTFT
    histogram runs from the request's arrival in its API server to its first token
    there, so the gap to the client's TTFT is the gateway, the relay and the HTTP hops."""
    head = (
        "| policy | engine prefix-cache hit rate | TTFT mean: engine (vLLM histogram) / "
        "client (ms) |\n|---|---|---|\n"
    )
    lines = []
    for row in rows:
        if row.engine_hit_rate is None or row.engine_ttft_s is None:
            continue
        client = [r.ttft_s for r in row.results if r.ok and r.ttft_s is not None]
        mean = sum(client) / len(client) if client else None
        lines.append(
            f"| {row.policy} | {_pct(row.engine_hit_rate)} | "
            f"{_ms(row.engine_ttft_s)} / {_ms(mean)} |"
        )
    return head + "\n".join(lines) if lines else ""


def mape(access: list[dict[str, Any]]) -> tuple[float | None, float | None, float | None, int]:
    """Engine-side TTFT MAPE over completed streams (all, and the later half: after
    warm-up), TPOT MAPE, and how many streams."""
    ttft_err, tpot_err = [], []
    for line in sorted(access, key=lambda line: line["ts"]):
        if line.get("status") != 200 or line.get("predicted_ttft_ms") is None:
            continue
        ttft, pred, disp = line.get("ttft_ms"), line["predicted_ttft_ms"], line["dispatched_ms"]
        if ttft is not None and ttft - disp > 0:
            ttft_err.append(abs(pred - ttft) / (ttft - disp))
        tpot, ptpot = line.get("tpot_ms"), line.get("predicted_tpot_ms")
        if tpot and tpot >= MIN_LEARNED_MS and ptpot is not None:  # not a burst (see predictor)
            tpot_err.append(abs(ptpot - tpot) / tpot)

    def avg(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    later = ttft_err[len(ttft_err) // 2 :]
    return avg(ttft_err), avg(later), avg(tpot_err), len(ttft_err)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def table(rows: list[Row]) -> str:
    head = (
        "| policy | SLO attained: chat / RAG / all | goodput (req/s) | "
        "TTFT p50 / p99 chat (ms) | TTFT p50 / p99 RAG (ms) | TTFT p99 all (ms) | "
        "shed (429) (of which rejected-slo) | other errors | prompt tokens cached | predictor MAPE TTFT (later half) / TPOT (n) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        pairs = list(zip(row.items, row.results, strict=True))
        by: dict[str, list[tuple[Item, RequestResult]]] = {"chat": [], "rag": []}
        for item, result in pairs:
            by[item.cls].append((item, result))
        rate = {
            k: (sum(attained(i, r) for i, r in v) / len(v) if v else None) for k, v in by.items()
        }
        good = sum(attained(i, r) for i, r in pairs)
        ttft = {k: [r.ttft_s for _, r in v if r.ok and r.ttft_s is not None] for k, v in by.items()}
        shed = sum(1 for r in row.results if r.status == 429)
        # latency-slo-admitter's message (its code, rejected-slo, is past the client's snippet)
        by_slo = sum(1 for r in row.results if r.status == 429 and "latency SLO" in (r.error or ""))
        other = sum(1 for r in row.results if not r.ok and r.status != 429)
        m_ttft, m_later, m_tpot, n = mape(row.access)
        errors = (
            "n/a (no predictor)"
            if row.policy in PEERS
            else f"{_pct(m_ttft)} ({_pct(m_later)}) / {_pct(m_tpot)} ({n})"
        )
        every = ttft["chat"] + ttft["rag"]
        prompt = sum(r.prompt_tokens or 0 for r in row.results if r.ok)
        cached = sum(r.cached_tokens or 0 for r in row.results if r.ok)
        engine = "" if row.engine_hit_rate is None else f" (engine {_pct(row.engine_hit_rate)})"
        lines.append(
            f"| {row.policy} | {_pct(rate['chat'])} / {_pct(rate['rag'])} / "
            f"{_pct(good / len(pairs))} | {good / row.wall_s:.2f} | "
            f"{_ms(percentile(ttft['chat'], 50))} / {_ms(percentile(ttft['chat'], 99))} | "
            f"{_ms(percentile(ttft['rag'], 50))} / {_ms(percentile(ttft['rag'], 99))} | "
            f"{_ms(percentile(every, 99))} | {shed} ({by_slo}) | {other} | {_pct(cached / max(1, prompt))}{engine} | "
            f"{errors} |"
        )
    return head + "\n".join(lines)


def windows(rows: list[Row], parts: int) -> str:
    """SLO attainment per slice of the run (load rising): the curve the plot shows."""
    head = "| policy | " + " | ".join(f"slice {k + 1}" for k in range(parts)) + " |\n"
    head += "|---|" + "---|" * parts + "\n"
    lines = []
    for row in rows:
        n = len(row.items)
        cells = []
        for k in range(parts):
            lo, hi = k * n // parts, (k + 1) * n // parts
            chunk = list(zip(row.items[lo:hi], row.results[lo:hi], strict=True))
            cells.append(_pct(sum(attained(i, r) for i, r in chunk) / max(1, len(chunk))))
        lines.append(f"| {row.policy} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines)


def nominal_rate(args: argparse.Namespace, t: float) -> float:
    """The offered rate the ramp had at time `t` of the run."""
    duration = args.requests / ((args.rate_start + args.rate_end) / 2)
    return args.rate_start + (args.rate_end - args.rate_start) * min(1.0, t / duration)


def plot(rows: list[Row], parts: int, path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        n = len(row.items)
        xs, att, p99 = [], [], []
        for k in range(parts):
            lo, hi = k * n // parts, (k + 1) * n // parts
            chunk = list(zip(row.items[lo:hi], row.results[lo:hi], strict=True))
            xs.append(nominal_rate(args, chunk[len(chunk) // 2][0].at))
            att.append(100 * sum(attained(i, r) for i, r in chunk) / max(1, len(chunk)))
            served = [r.ttft_s for _, r in chunk if r.ok and r.ttft_s is not None]
            p99.append(1000 * (percentile(served, 99) or 0.0))
        left.plot(xs, att, marker="o", label=row.policy)
        right.plot(xs, p99, marker="o", label=row.policy)
    left.set_xlabel("offered load (req/s, the ramp at the slice's middle)")
    left.set_ylabel("SLO attained (% of requests sent)")
    right.set_xlabel("offered load (req/s, the ramp at the slice's middle)")
    right.set_ylabel("TTFT p99 of served requests (ms)")
    right.set_yscale("log")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> None:
    if args.trace:
        from latency_replay import record_to

        record_to(args.trace)
    items = workload(args)
    rows = await run_policies(args.policy or list(DEFAULT_POLICIES), items, args)
    report(rows, items, args)


def report(rows: list[Row], items: list[Item], args: argparse.Namespace) -> None:
    print()
    chats = sum(1 for i in items if i.cls == "chat")
    print(
        f"{len(items)} requests ({chats} chats, {len(items) - chats} RAG over {args.documents} "
        f"documents of {args.doc_words} words), rate {args.rate_start:g} → {args.rate_end:g} "
        f"req/s over {items[-1].at:.0f} s, "
        + (
            f"{len(args.urls)} real vLLM servers (tiny model, CPU), policies one after another"
            if args.urls
            else f"{args.replicas} simulated replicas at speed {args.speed:g}"
            + (f" (one at ×{args.slow_factor:g})" if args.slow_factor != 1 else "")
        )
        + f", seed {args.seed}; SLO chat {args.chat_ttft_ms} ms TTFT / {args.chat_tpot_ms} ms "
        f"TPOT, RAG {args.rag_ttft_ms} / {args.rag_tpot_ms} (sheddable); Python "
        f"{platform.python_version()} on {platform.machine()}, {sys.platform}"
    )
    print(table(rows))
    print()
    print(windows(rows, args.slices))
    engines = engine_table(rows)
    if engines:
        print()
        print(engines)
    if args.plot:
        plot(rows, args.slices, args.plot, args)
        print(f"\nplot: {args.plot}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", action="append", choices=sorted([*POLICIES, *PEERS]))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--speed", type=float, default=0.05)
    p.add_argument("--slow-factor", type=float, default=0.4)
    p.add_argument("--rate-start", type=float, default=0.3)
    p.add_argument("--rate-end", type=float, default=2.2)
    p.add_argument("--chat-share", type=float, default=0.7)
    p.add_argument("--documents", type=int, default=12)
    p.add_argument("--doc-words", type=int, default=1500)
    p.add_argument("--chat-ttft-ms", type=int, default=1000)
    p.add_argument("--chat-tpot-ms", type=int, default=200)
    p.add_argument("--rag-ttft-ms", type=int, default=5000)
    p.add_argument("--rag-tpot-ms", type=int, default=300)
    p.add_argument("--slices", type=int, default=6)
    p.add_argument("--plot", default=None)
    p.add_argument(
        "--trace",
        default=None,
        help="record what the predictor saw here (JSONL) for bench/latency_replay.py",
    )
    p.add_argument(
        "--peers",
        type=Path,
        default=REPO / ".venv-peers" / "bin",
        help="folder with the vllm-router and sglang-router executables "
        "(default: .venv-peers/bin of the repository)",
    )
    p.add_argument("--vllm", type=int, default=0, help="N real vLLM servers instead of simulators")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--sequential",
        action="store_true",
        help="one policy after the other (default: all at once)",
    )
    args = p.parse_args(argv)
    missing = missing_peers(args.policy or [], args.peers)
    if missing:
        p.error(f"no peer router at {', '.join(missing)}: install it there or pass --peers DIR")
    return args


def run_on_vllm(args: argparse.Namespace) -> None:
    """The same, on `--vllm` real vLLM servers (started once, stopped at the end)."""
    import signal
    import tempfile

    from servegate.testing.tinymodel import build_tiny_model
    from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="servegate-latency-"))
    # vLLM reports `usage.prompt_tokens_details.cached_tokens` only with this flag; without
    # it the cached-tokens column read 0 % and the gateway never saw the engine's count
    settings = ClusterSettings(replicas=args.vllm, extra_args=("--enable-prompt-tokens-details",))
    cluster = VllmCluster(build_tiny_model(), settings, workdir / "vllm")
    try:
        cluster.start()
        print(f"{args.vllm} vLLM servers healthy after {cluster.startup_s:.0f} s", flush=True)
        args.urls = cluster.urls
        args.sequential = True
        asyncio.run(main(args))
    finally:
        cluster.stop()


if __name__ == "__main__":
    parsed = parse_args()
    parsed.urls = []
    parsed.model = VLLM_MODEL if parsed.vllm else MODEL
    if parsed.vllm:
        sys.path.insert(0, str(Path(__file__).parent))
        run_on_vllm(parsed)
    else:
        asyncio.run(main(parsed))
