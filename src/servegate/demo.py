"""`servegate demo`: the gateway on an embedded simulator cluster, with a live view.

Everything runs in one process and one event loop: N simulated vLLM replicas (the
first with LoRA adapters), the gateway with a cache- and load-aware profile, and
optionally built-in traffic. `--duration` makes it a bounded run that ends with a
summary and exits non-zero if the run did not show what it should.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import aiohttp
import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

DEMO_PICKER = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {blockSizeTokens: 16, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 2}
  - {pluginRef: lora-affinity-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""
MODEL = "sim-model"
ADAPTERS = ("sql-lora", "chat-lora")


@dataclass(slots=True)
class TrafficStats:
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def _replica_configs(replicas: int, speed: float) -> list[dict[str, Any]]:
    out = []
    for i in range(replicas):
        cfg: dict[str, Any] = {
            "model": MODEL,
            "num_blocks": 512,
            "block_size": 16,
            "max_num_seqs": 32,
            "speed": speed,
        }
        if i == 0:
            cfg["lora"] = {"max_loras": 2, "adapters": list(ADAPTERS)}
        out.append(cfg)
    return out


def _table(gw: Any, started: float, traffic: TrafficStats | None) -> Table:
    elapsed = time.monotonic() - started
    title = f"servegate demo — {elapsed:5.1f} s"
    if traffic is not None:
        title += f" — sent {traffic.sent}, ok {traffic.ok}, errors {sum(traffic.errors.values())}"
    table = Table(title=title)
    for col in (
        "replica",
        "ready",
        "queue",
        "running",
        "KV %",
        "prefix hit %",
        "routed",
        "in flight",
    ):
        table.add_column(col, justify="right")
    for state in gw.pool:
        m = state.metrics
        hit = (
            f"{100.0 * m.prefix_cache_hits / m.prefix_cache_queries:5.1f}"
            if m.prefix_cache_queries and m.prefix_cache_hits is not None
            else "-"
        )
        table.add_row(
            state.address,
            "yes" if state.healthy else "no",
            f"{m.waiting:.0f}",
            f"{m.running:.0f}",
            f"{100.0 * m.kv_usage:5.1f}",
            hit,
            str(state.picks),
            str(state.in_flight_requests),
        )
    return table


async def _traffic_loop(
    url: str, kind: str, concurrency: int, stop: asyncio.Event, stats: TrafficStats, seed: int
) -> None:
    from servegate.bench.client import send_request
    from servegate.bench.workloads import Api, RandomWorkload, SharedPrefixWorkload

    if kind == "shared-prefix":
        requests = SharedPrefixWorkload(
            num_groups=6, prompts_per_group=40, system_prompt_len=400, question_len=40,
            output_len=16,
        ).generate(model=MODEL, api=Api.CHAT, seed=seed)  # fmt: skip
    else:
        requests = RandomWorkload(num_requests=240, prompt_len=200, output_len=16).generate(
            model=MODEL, api=Api.CHAT, seed=seed
        )
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                for i in range(len(requests)):
                    queue.put_nowait(i)
                continue
            stats.sent += 1
            result = await send_request(session, url, requests[index], stream=True)
            if result.ok:
                stats.ok += 1
            else:
                key = f"{result.status or result.error_kind}"
                stats.errors[key] = stats.errors.get(key, 0) + 1

    async with aiohttp.ClientSession() as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await stop.wait()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


def _summary(console: Console, gw: Any, traffic: TrafficStats | None) -> bool:
    console.print(_table(gw, gw_started(gw), traffic))
    states = list(gw.pool)
    hits = sum(s.metrics.prefix_cache_hits or 0.0 for s in states)
    queries = sum(s.metrics.prefix_cache_queries or 0.0 for s in states)
    rate = hits / queries if queries else 0.0
    console.print(
        f"cluster prefix hit rate: {100.0 * rate:.1f} % ({hits:.0f}/{queries:.0f} tokens)"
    )
    if traffic is None:
        return True
    served = [s.picks for s in states]
    cancelled = traffic.sent - traffic.ok - sum(traffic.errors.values())
    console.print(
        f"requests: sent {traffic.sent}, ok {traffic.ok}, errors {traffic.errors or 0}, "
        f"cut off by the end of the run {cancelled}; routed per replica {served}"
    )
    ok = all(n > 0 for n in served) and rate > 0 and not traffic.errors
    if not ok:
        console.print("[red]the run did not show every replica serving with cache hits[/red]")
    return ok


def gw_started(gw: Any) -> float:
    started: float = time.monotonic() - (time.time() - gw.started_at)
    return started


async def run_demo(
    replicas: int,
    host: str,
    port: int,
    traffic: str | None,
    duration: float | None,
    concurrency: int,
    speed: float,
    show_table: bool,
) -> bool:
    from servegate.config import parse_config
    from servegate.testing.cluster import SimCluster
    from servegate.testing.gateway import GatewayRunner

    console = Console()
    async with SimCluster(replicas, overrides=_replica_configs(replicas, speed)) as cluster:
        config = parse_config(
            "",
            "<demo>",
            environ={},
            overrides={
                "gateway": {"host": host, "port": port, "debug_headers": True},
                "pool": {"endpoints": [{"url": url} for url in cluster.urls]},
                "picker": yaml.safe_load(DEMO_PICKER),
            },
        )
        async with GatewayRunner(config, host=host) as runner:
            gw = runner.gateway
            console.print(
                f"[bold]servegate gateway:[/bold] {runner.url}  (replicas: {', '.join(cluster.urls)})"
            )
            console.print(
                f"try: curl {runner.url}/v1/chat/completions -H 'content-type: application/json' "
                f'-d \'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hello"}}]}}\''
            )
            console.print(
                f"LoRA adapters on {cluster.urls[0]}: {', '.join(ADAPTERS)}; Ctrl-C stops."
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
            deadline = time.monotonic() + duration if duration else None
            await _wait_ready(gw, replicas, 20.0)
            stats = TrafficStats() if traffic else None
            traffic_task = (
                asyncio.create_task(
                    _traffic_loop(runner.url, traffic, concurrency, stop, stats, seed=0)
                )
                if traffic and stats is not None
                else None
            )
            started = time.monotonic()
            live = (
                Live(_table(gw, started, stats), console=console, refresh_per_second=4)
                if show_table
                else None
            )
            with live if live is not None else contextlib.nullcontext():
                while not stop.is_set():
                    if deadline is not None and time.monotonic() >= deadline:
                        stop.set()
                        break
                    if live is not None:
                        live.update(_table(gw, started, stats))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)
            if traffic_task is not None:
                await traffic_task
            await asyncio.sleep(0.3)  # one more scrape so the summary has the last counters
            return _summary(console, gw, stats)


async def _wait_ready(gw: Any, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.pool.ready_count() == replicas and gw.pool.resolve_model(MODEL) is not None:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the simulated replicas did not become ready in time")


def demo_command(
    replicas: Annotated[int, typer.Option(min=1, max=16, help="Simulated replicas.")] = 3,
    host: Annotated[str, typer.Option(help="Gateway listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8080,
    traffic: Annotated[
        str | None, typer.Option(help="Built-in traffic: shared-prefix or random.")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds and print a summary.")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Concurrent traffic streams.")] = 8,
    speed: Annotated[float, typer.Option(help="Simulator speed factor.")] = 1.0,
    table: Annotated[bool, typer.Option("--table/--no-table", help="Live table.")] = True,
) -> None:
    """Run the gateway on an embedded simulator cluster."""
    from servegate.gateway.server import event_loop_factory

    if traffic not in (None, "shared-prefix", "random"):
        raise typer.BadParameter("--traffic must be shared-prefix or random")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        ok = runner.run(
            run_demo(replicas, host, port, traffic, duration, concurrency, speed, table)
        )
    if not ok:
        raise typer.Exit(1)
