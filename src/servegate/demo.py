"""`servegate demo`: round-robin against servegate's default, on one simulated cluster.

Everything runs in one process and one event loop: `replicas` simulated vLLM replicas
whose prefix caches each hold only a few of the workload's shared system prompts
(the cluster holds them all), and two gateways in front of them — one with a
round-robin picker, one with servegate's default picker config (prefix-aware and
load-aware, fed by the replicas' KV events). The same seeded requests go through each
gateway in turn, every replica's prefix cache is reset in between, and the replicas'
own counters (`vllm:prefix_cache_hits_total` / `_queries_total`,
`vllm:request_success_total`) say what each policy achieved. A live view shows
per-replica load, cache hits and routing share; the run ends with a side-by-side
summary and, with `--keep-running`, leaves the servegate gateway serving (its status
page at `/ui`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import aiohttp
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from servegate.bench.client import RequestResult, send_request
from servegate.bench.engine_counters import (
    EngineCounters,
    reset_prefix_cache,
    scrape_counters,
)
from servegate.bench.stats import balance, percentile
from servegate.bench.workloads import Api, BenchRequest, SharedPrefixWorkload

MODEL = "sim-model"
ROUND_ROBIN = "round-robin"
DEFAULT_PHASE_S = 20.0
SERVEGATE = "servegate"
ROUND_ROBIN_PICKER: dict[str, Any] = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "round-robin-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "round-robin-picker"}]}],
}


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """The cluster, workload and load; the defaults are what `make demo` runs."""

    replicas: int = 4
    num_blocks: int = 160
    """KV blocks per replica (16 tokens each): room for about 4 of the 12 shared prompts."""
    block_size: int = 16
    groups: int = 12
    prompts_per_group: int = 40
    system_prompt_len: int = 300
    """Words; the simulator's tokenizer makes about 1.9 tokens of each."""
    question_len: int = 24
    output_len: int = 16
    concurrency: int = 8
    phase_seconds: float = DEFAULT_PHASE_S
    """Seconds of traffic per policy, over all its turns."""
    max_requests: int | None = None
    """Requests per policy over all its turns (a bounded, timing-free run)."""
    rounds: int = 2
    """Turns per policy, in the order A B B A (A B B A A B … for more), so a machine
    whose speed drifts during the run slows both policies alike."""
    speed: float = 1.0
    kv_events: bool = True
    """servegate's gateway subscribes to the replicas' KV events and tokenizes prompts
    (the precise prefix scorer of the default profile); False: approximate scorer only."""
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8080
    """The servegate gateway's port (the round-robin one takes a free port)."""

    def sim_config(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": 2048,
            "max_num_seqs": 32,
            "speed": self.speed,
        }

    @property
    def workload(self) -> SharedPrefixWorkload:
        return SharedPrefixWorkload(
            num_groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            system_prompt_len=self.system_prompt_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )

    def gateway_config(
        self, urls: Sequence[str], kv_events: Sequence[str | None], picker: dict[str, Any] | None
    ) -> dict[str, Any]:
        endpoints: list[dict[str, Any]] = []
        for url, events in zip(urls, kv_events, strict=True):
            endpoint: dict[str, Any] = {"url": url, "model": MODEL}
            if events and picker is None and self.kv_events:
                endpoint["kv_events"] = events
            endpoints.append(endpoint)
        # Patient probes: on a machine this busy the replicas share the demo's one event
        # loop, and a late answer is not a dead replica.
        pool: dict[str, Any] = {
            "endpoints": endpoints,
            "scrape_interval_s": 0.2,
            "scrape_timeout_s": 5.0,
            "health": {"timeout_s": 5.0, "failure_threshold": 5},
        }
        if picker is None and self.kv_events:
            pool["tokenizer"] = {"source": "simulator"}
        config: dict[str, Any] = {
            "gateway": {
                "host": self.host,
                "port": self.port if picker is None else 0,
                "seed": self.seed,
                "access_log": False,
            },
            "pool": pool,
        }
        if picker is not None:
            config["picker"] = picker
        return config


@dataclass(slots=True)
class PhaseResult:
    """One policy's share of the run."""

    policy: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    hits: dict[str, float] = field(default_factory=dict)
    """Per replica URL: prefix-cache hits during the phase (tokens, engine counter)."""
    queries: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)
    """Per replica URL: requests finished during the phase (engine counter)."""
    cache_resets_failed: int = 0

    def add(self, other: PhaseResult) -> None:
        """Fold another turn of the same policy into this one."""
        self.results.extend(other.results)
        self.wall_s += other.wall_s
        self.cache_resets_failed += other.cache_resets_failed
        for mine, theirs in (
            (self.hits, other.hits),
            (self.queries, other.queries),
            (self.served, other.served),
        ):
            for url, value in theirs.items():
                mine[url] = mine.get(url, 0.0) + value

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def hit_rate(self) -> float | None:
        queries = sum(self.queries.values())
        return sum(self.hits.values()) / queries if queries > 0 else None

    def ttft(self, q: float) -> float | None:
        return percentile([r.ttft_s for r in self.ok if r.ttft_s is not None], q)

    @property
    def output_tok_per_s(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def req_per_s(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def balance(self) -> float | None:
        return balance(list(self.served.values()))


@dataclass(slots=True)
class DemoResult:
    spec: DemoSpec
    replica_urls: list[str]
    phases: list[PhaseResult]

    def phase(self, policy: str) -> PhaseResult:
        return next(p for p in self.phases if p.policy == policy)

    @property
    def shows_the_difference(self) -> bool:
        """Both phases ran cleanly, every replica served, and servegate hit more."""
        rr, sg = self.phase(ROUND_ROBIN), self.phase(SERVEGATE)
        clean = all(p.results and not p.errors for p in self.phases)
        spread = all(v > 0 for v in sg.served.values()) and len(sg.served) == len(self.replica_urls)
        return (
            clean
            and spread
            and rr.hit_rate is not None
            and sg.hit_rate is not None
            and sg.hit_rate > rr.hit_rate
        )


# -- presentation -------------------------------------------------------------------


def short_names(urls: Sequence[str]) -> dict[str, str]:
    """`r1`, `r2`, … in the cluster's order, so tables fit 80 columns."""
    return {url: f"r{i + 1}" for i, url in enumerate(urls)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f} %"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base <= 0:
        return "-"
    return f"{value / base:.2f}×"


def live_table(
    policy: str,
    gw: Any,
    names: dict[str, str],
    start: dict[str, tuple[float, float, int]],
    elapsed: float,
    results: Sequence[RequestResult],
    limit_s: float,
) -> Table:
    """Per replica: queue, running, KV use, prefix hit rate and routing share this phase.

    `start` holds each address's (hits, queries, picks) when the phase began; the
    gateway's scrapes of the replicas' counters give the rest.
    """
    ok = sum(1 for r in results if r.ok)
    ttft = percentile([r.ttft_s for r in results if r.ok and r.ttft_s is not None], 50)
    title = (
        f"{policy}: {elapsed:4.1f}/{limit_s:.0f} s, {ok} ok, "
        f"{len(results) - ok} errors, TTFT p50 {_ms(ttft)}"
    )
    table = Table(title=title, title_justify="left", min_width=60)
    for column in ("replica", "queue", "running", "KV use", "hit rate", "routed", "share"):
        table.add_column(column, justify="right")
    states = list(gw.pool)
    picks = {s.address: s.picks - start.get(s.address, (0.0, 0.0, 0))[2] for s in states}
    total = sum(picks.values())
    by_url = {s.endpoint.url.rstrip("/"): s for s in states}
    for url, name in names.items():
        state = by_url.get(url.rstrip("/"))
        if state is None:
            continue
        m = state.metrics
        h0, q0, _ = start.get(state.address, (0.0, 0.0, 0))
        queries = (m.prefix_cache_queries or 0.0) - q0
        hits = (m.prefix_cache_hits or 0.0) - h0
        share = picks[state.address] / total if total else None
        table.add_row(
            name,
            f"{m.waiting:.0f}",
            f"{m.running:.0f}",
            _pct(m.kv_usage),
            _pct(hits / queries if queries > 0 else None),
            str(picks[state.address]),
            _pct(share),
        )
    return table


def summary_table(result: DemoResult) -> Table:
    rr, sg = result.phase(ROUND_ROBIN), result.phase(SERVEGATE)
    names = short_names(result.replica_urls)

    def split(phase: PhaseResult) -> str:
        return "/".join(f"{phase.served.get(u, 0.0):.0f}" for u in names)

    table = Table(
        title="Same traffic, same cluster",
        title_justify="left",
        caption="ratio = servegate / round-robin",
        caption_justify="left",
    )
    table.add_column("")
    table.add_column(ROUND_ROBIN, justify="right")
    table.add_column(SERVEGATE, justify="right")
    table.add_column("ratio", justify="right")
    rows: list[tuple[str, str, str, str]] = [
        ("requests (errors)", f"{len(rr.results)} ({rr.errors})", f"{len(sg.results)} ({sg.errors})", ""),
        ("cache hit rate", _pct(rr.hit_rate), _pct(sg.hit_rate), _ratio(sg.hit_rate, rr.hit_rate)),
        ("TTFT p50", _ms(rr.ttft(50)), _ms(sg.ttft(50)), _ratio(sg.ttft(50), rr.ttft(50))),
        ("TTFT p99", _ms(rr.ttft(99)), _ms(sg.ttft(99)), _ratio(sg.ttft(99), rr.ttft(99))),
        (
            "output tokens/s",
            f"{rr.output_tok_per_s:.0f}",
            f"{sg.output_tok_per_s:.0f}",
            _ratio(sg.output_tok_per_s, rr.output_tok_per_s),
        ),
        (
            "balance (max/mean)",
            "-" if rr.balance is None else f"{rr.balance:.2f}",
            "-" if sg.balance is None else f"{sg.balance:.2f}",
            _ratio(sg.balance, rr.balance),
        ),
        (f"per replica ({'/'.join(names.values())})", split(rr), split(sg), ""),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    return table


def print_summary(console: Console, result: DemoResult) -> None:
    console.print()
    console.print(summary_table(result))
    rr, sg = result.phase(ROUND_ROBIN), result.phase(SERVEGATE)
    console.print(
        "Hit rate and requests per replica: the replicas' own counters. TTFT and "
        "throughput: measured by the demo's client; lower TTFT and higher tokens/s are "
        "better, balance 1.00 is perfectly even."
    )
    if result.shows_the_difference:
        console.print(
            f"[bold green]servegate served {_pct(sg.hit_rate)} of prompt tokens from cache, "
            f"round-robin {_pct(rr.hit_rate)}.[/bold green]"
        )
    else:
        console.print(
            "[red]this run did not show the difference (errors, an idle replica, or no "
            "higher hit rate); see above[/red]"
        )
    failed = sum(p.cache_resets_failed for p in result.phases)
    if failed:
        console.print(f"[yellow]warning: {failed} prefix-cache resets were refused[/yellow]")


# -- the run ------------------------------------------------------------------------


def turn_order(rounds: int) -> list[str]:
    """A B, B A, A B, …: each pair of turns swaps which policy goes first."""
    order: list[str] = []
    for index in range(rounds):
        pair = [ROUND_ROBIN, SERVEGATE]
        order += pair if index % 2 == 0 else pair[::-1]
    return order


async def _counters(
    session: aiohttp.ClientSession, urls: Sequence[str]
) -> list[EngineCounters | None]:
    return list(await asyncio.gather(*(scrape_counters(session, u) for u in urls)))


async def _send_phase(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[BenchRequest],
    spec: DemoSpec,
    seconds: float,
    limit: int | None,
    results: list[RequestResult],
    stop: asyncio.Event,
) -> None:
    """A closed loop of `concurrency` workers cycling over `requests` until the turn ends."""
    deadline = time.monotonic() + seconds
    index = 0

    def next_request() -> BenchRequest | None:
        nonlocal index
        if stop.is_set() or time.monotonic() >= deadline:
            return None
        if limit is not None and index >= limit:
            return None
        request = requests[index % len(requests)]
        index += 1
        return request

    async def worker() -> None:
        while (request := next_request()) is not None:
            results.append(await send_request(session, url, request, stream=True, timeout_s=60.0))

    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))


async def _run_phase(
    policy: str,
    label: str,
    seconds: float,
    limit: int | None,
    runner: Any,
    session: aiohttp.ClientSession,
    urls: list[str],
    requests: Sequence[BenchRequest],
    spec: DemoSpec,
    console: Console,
    live_view: bool,
    stop: asyncio.Event,
) -> PhaseResult:
    phase = PhaseResult(policy)
    resets = await asyncio.gather(*(reset_prefix_cache(session, u) for u in urls))
    phase.cache_resets_failed = resets.count(False)
    gw = runner.gateway
    await asyncio.sleep(0.3)  # a scrape after the reset, so the live view starts from it
    start = {
        s.address: (s.metrics.prefix_cache_hits or 0.0, s.metrics.prefix_cache_queries or 0.0, s.picks)
        for s in gw.pool
    }  # fmt: skip
    before = await _counters(session, urls)
    names = short_names(urls)
    started = time.monotonic()
    sender = asyncio.create_task(
        _send_phase(session, runner.url, requests, spec, seconds, limit, phase.results, stop)
    )

    def view() -> Table:
        elapsed = time.monotonic() - started
        return live_table(label, gw, names, start, elapsed, phase.results, seconds)

    if live_view and console.is_terminal:
        with Live(view(), console=console, refresh_per_second=4, transient=False) as live:
            while not sender.done():
                await asyncio.wait({sender}, timeout=0.25)
                live.update(view())
    else:
        # No terminal (a pipe, CI): a progress line now and then instead of redrawing.
        next_line = started + 5.0
        while not sender.done():
            await asyncio.wait({sender}, timeout=0.25)
            if live_view and time.monotonic() >= next_line and not sender.done():
                next_line += 5.0
                console.print(view())
        if live_view:
            console.print(view())
    await sender
    phase.wall_s = time.monotonic() - started
    await asyncio.sleep(0.05)
    after = await _counters(session, urls)
    for url, first, last in zip(urls, before, after, strict=True):
        if first is None or last is None:
            continue
        if first.prefix_hits is not None and last.prefix_hits is not None:
            phase.hits[url] = last.prefix_hits - first.prefix_hits
        if first.prefix_queries is not None and last.prefix_queries is not None:
            phase.queries[url] = last.prefix_queries - first.prefix_queries
        if first.requests is not None and last.requests is not None:
            phase.served[url] = last.requests - first.requests
    return phase


async def _wait_ready(gw: Any, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            gw.pool.ready_count() == replicas
            and gw.pool.resolve_model(MODEL) is not None
            and all(s.metrics.scraped_at > 0 for s in gw.pool)
        ):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the simulated replicas did not become ready in time")


async def run_demo(
    spec: DemoSpec,
    console: Console | None = None,
    *,
    live_view: bool = True,
    keep_running: bool = False,
) -> DemoResult:
    """The whole demo; SIGINT/SIGTERM end it early (KeyboardInterrupt) while it runs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        return await _demo(spec, console or Console(), live_view, keep_running, stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _demo(
    spec: DemoSpec, console: Console, live_view: bool, keep_running: bool, stop: asyncio.Event
) -> DemoResult:
    from servegate.testing.cluster import SimCluster
    from servegate.testing.gateway import GatewayRunner

    base = spec.sim_config()
    async with (
        SimCluster(spec.replicas, base=base, kv_events="tcp", host=spec.host) as cluster,
        aiohttp.ClientSession() as session,
    ):
        urls = list(cluster.urls)
        events = [s.kv_events_endpoint for s in cluster.servers]
        rr_config = spec.gateway_config(urls, events, ROUND_ROBIN_PICKER)
        sg_config = spec.gateway_config(urls, events, None)
        async with (
            GatewayRunner(rr_config, host=spec.host) as rr,
            GatewayRunner(sg_config, host=spec.host) as sg,
        ):
            await asyncio.gather(
                _wait_ready(rr.gateway, spec.replicas, 20.0),
                _wait_ready(sg.gateway, spec.replicas, 20.0),
            )
            _print_intro(console, spec, urls, sg.url)
            requests = spec.workload.generate(model=MODEL, api=Api.COMPLETIONS, seed=spec.seed)
            merged = {ROUND_ROBIN: PhaseResult(ROUND_ROBIN), SERVEGATE: PhaseResult(SERVEGATE)}
            turns = turn_order(spec.rounds)
            runners = {ROUND_ROBIN: rr, SERVEGATE: sg}
            seconds = spec.phase_seconds / spec.rounds
            done = 0
            for number, policy in enumerate(turns):
                if stop.is_set():
                    break
                turn = number // 2
                limit = None
                if spec.max_requests is not None:
                    limit = spec.max_requests // spec.rounds + (
                        1 if turn < spec.max_requests % spec.rounds else 0
                    )
                label = f"{policy} (turn {turn + 1} of {spec.rounds})"
                turn_result = await _run_phase(
                    policy, label, seconds, limit, runners[policy], session, urls,
                    requests, spec, console, live_view, stop,
                )  # fmt: skip
                merged[policy].add(turn_result)
                done += 1
            phases = list(merged.values())
            if done < len(turns):
                raise KeyboardInterrupt
            result = DemoResult(spec, urls, phases)
            print_summary(console, result)
            if keep_running and not stop.is_set():
                console.print(
                    f"\nservegate keeps serving at {sg.url} (status page {sg.url}/ui); "
                    "Ctrl-C stops.\n"
                    f"try: curl {sg.url}/v1/completions -H 'content-type: application/json' "
                    f'-d \'{{"model": "{MODEL}", "prompt": "hello", "max_tokens": 8}}\''
                )
                await stop.wait()
            return result


def _print_intro(console: Console, spec: DemoSpec, urls: Sequence[str], sg_url: str) -> None:
    cacheable = (spec.num_blocks - 1) * spec.block_size
    console.print(
        Text.assemble(
            ("servegate demo", "bold"),
            f": {spec.replicas} simulated vLLM replicas, {cacheable} cacheable tokens each "
            f"— about {spec.system_prompt_len * 1.9 * spec.groups / cacheable:.1f}× "
            f"smaller than the {spec.groups} shared system prompts of the workload "
            f"({spec.system_prompt_len} words each, {spec.prompts_per_group} questions "
            f"per prompt, {spec.concurrency} requests in flight).",
        )
    )
    limit = f"{spec.phase_seconds:g} s" + (
        f" or {spec.max_requests} requests" if spec.max_requests else ""
    )
    console.print(
        f"The same requests go through round-robin and through servegate's default "
        f"picker ({limit} each, in {spec.rounds} turns, alternating); every replica's "
        "prefix cache is reset before each turn."
    )
    for url, name in short_names(urls).items():
        console.print(f"  {name} = {url}", highlight=False)
    console.print(f"servegate gateway: {sg_url}  (status page: {sg_url}/ui)", highlight=False)


def demo_command(
    replicas: Annotated[int, typer.Option(min=2, max=16, help="Simulated replicas.")] = 4,
    host: Annotated[str, typer.Option(help="Gateway listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The servegate gateway's port (0: any).")] = 8080,
    seconds: Annotated[
        float, typer.Option("--seconds", min=1.0, help="Seconds of traffic per policy.")
    ] = DEFAULT_PHASE_S,
    max_requests: Annotated[
        int | None, typer.Option(min=1, help="Requests per policy (split over its turns).")
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Turns per policy, alternating A B B A.")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 8,
    speed: Annotated[float, typer.Option(help="Simulator speed factor.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seeds the workload.")] = 0,
    table: Annotated[bool, typer.Option("--table/--no-table", help="Live view.")] = True,
    keep_running: Annotated[
        bool,
        typer.Option(help="Keep the servegate gateway serving after the comparison."),
    ] = False,
) -> None:
    """Round-robin against servegate's default on a simulated cluster, side by side."""
    from servegate.gateway.server import event_loop_factory

    spec = DemoSpec(
        replicas=replicas,
        host=host,
        port=port,
        phase_seconds=seconds,
        max_requests=max_requests,
        rounds=rounds,
        concurrency=concurrency,
        speed=speed,
        seed=seed,
    )
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            result = runner.run(run_demo(spec, live_view=table, keep_running=keep_running))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if not result.shows_the_difference:
        raise typer.Exit(1)
