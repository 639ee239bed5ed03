"""Scale-out: throughput and CPU per worker count, and hit rate across replicas (not a test).

    .venv/bin/python bench/scaleout.py                       # both parts
    .venv/bin/python bench/scaleout.py --part throughput --workers 1,2 --concurrency 32
    .venv/bin/python bench/scaleout.py --part hitrate --requests 480

Throughput: the fast backend (`servegate.testing.fastbackend`, canned answers) in
its own process and one `servegate serve --workers N` per N, all started at once;
rounds alternate between them with the same requests at the same concurrency.
Reported per N: requests/s, p50 latency, and gateway CPU per request (utime + stime
of the supervisor and all its workers, /proc/<pid>/stat). This process is the load
generator and shares the machine's cores with the gateways: state `os.cpu_count()`
next to the numbers.

Hit rate: 4 simulated replicas (in this process) with small KV caches, shared-prefix
traffic (`--groups` system prompts whose prefixes together fit the cluster's cache
but not one replica's, each request a group prefix plus a fresh question), closed-loop
clients. Three setups on a fresh cluster each, same requests: one gateway; two
gateways behind a round-robin client without sharing (each has its own
approximate-prefix index); the same two with `scaleout.bind`/`peers` (insertions and
in-flight counts shared). Hit rate = prompt tokens found in the replicas' prefix caches
/ prompt tokens looked up, from the simulators' own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from gateway_overhead import (
    Server,
    process_tree_cpu_s,
    requests_for,
    start_backend,
    start_gateway,
)
from prefix_workload import (
    Workload,
    drive,
    gateway_config,
    make_workload,
    sim_config,
    snapshot,
    totals,
    wait_ready,
)
from servegate.bench.runner import LoadKind, LoadPoint, SendOptions, run_segment
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

# -- throughput -------------------------------------------------------------------------


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    latencies: list[float] | None = None


async def throughput(args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.workers.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="sg-scaleout-"))
    backend = start_backend(log_dir, 8, 20.0)
    gateways: dict[int, Server] = {}
    try:
        for n in counts:
            template = (
                "{python} -m servegate.cli serve -e {backend} --port {port} --host 127.0.0.1"
                f" --workers {n}"
            )
            server, why = await asyncio.to_thread(start_gateway, template, backend, log_dir, 30.0)
            if server is None:
                raise RuntimeError(why)
            gateways[n] = server
        await asyncio.sleep(2.0)  # every worker up (the probe answered from one)
        tallies = {n: Tally(latencies=[]) for n in counts}
        if args.client == "wrk":
            await asyncio.to_thread(drive_with_wrk, args, counts, gateways, tallies, log_dir)
        else:
            await drive_with_python(args, counts, gateways, tallies)
    finally:
        for server in gateways.values():
            server.stop()
        backend.stop()
    print(
        f"\n### Throughput: {args.concurrency} concurrent clients, non-streaming, "
        f"{args.rounds} alternating rounds, {os.cpu_count()} CPU cores shared with the load "
        "generator and the backend\n"
    )
    print(
        "| workers | requests ok / errors | requests/s | p50 latency (ms) | gateway CPU per request (µs) | req/s vs 1 worker |"
    )
    print("|---|---|---|---|---|---|")
    base = None
    for n in counts:
        t = tallies[n]
        rps = t.ok / t.wall_s if t.wall_s else 0.0
        base = base or rps
        p50 = statistics.median(t.latencies or [0.0]) * 1000
        cpu = t.cpu_s / max(1, t.ok + t.errors) * 1e6
        print(
            f"| {n} | {t.ok} / {t.errors} | {rps:.0f} | {p50:.1f} | {cpu:.0f} | {rps / base:.2f}x |"
        )


async def drive_with_python(
    args: argparse.Namespace,
    counts: list[int],
    gateways: dict[int, Server],
    tallies: dict[int, Tally],
) -> None:
    """This process's aiohttp client: the same load generator as the other benches."""
    batch = requests_for(args.requests // args.rounds)
    point = LoadPoint(LoadKind.CONCURRENCY, args.concurrency)
    options = SendOptions(stream=False, timeout_s=30.0)
    connector = aiohttp.TCPConnector(limit=0, force_close=args.fresh_connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        for server in gateways.values():
            await run_segment(session, server.url, batch, point, options=options, duration_s=10)
        for r in range(args.rounds):
            order = counts if r % 2 == 0 else counts[::-1]
            for n in order:
                server = gateways[n]
                before = process_tree_cpu_s(server.process.pid)
                seg = await run_segment(
                    session, server.url, batch, point, options=options, duration_s=60
                )
                t = tallies[n]
                t.cpu_s += process_tree_cpu_s(server.process.pid) - before
                t.wall_s += seg.wall_s
                t.ok += sum(1 for x in seg.results if x.ok)
                t.errors += sum(1 for x in seg.results if not x.ok)
                assert t.latencies is not None
                t.latencies.extend(x.e2e_s for x in seg.results if x.ok)


WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
"""


def _wrk_field(pattern: str, out: str) -> str:
    match = re.search(pattern, out)
    if match is None:
        raise RuntimeError(f"wrk printed no {pattern!r}:\n{out}")
    return match.group(1)


def drive_with_wrk(
    args: argparse.Namespace,
    counts: list[int],
    gateways: dict[int, Server],
    tallies: dict[int, Tally],
    log_dir: Path,
) -> None:
    """wrk (C, one thread) as the load generator: it costs far less CPU than a Python
    client, so more of the 2 cores is left to the gateway workers."""
    body = requests_for(1)[0].body(stream=False).decode()
    script = log_dir / "post.lua"
    script.write_text(WRK_SCRIPT % body)
    seconds = max(1, round(args.wrk_seconds))
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]
        for n in order:
            server = gateways[n]
            before = process_tree_cpu_s(server.process.pid)
            out = subprocess.run(
                ["wrk", "-t1", f"-c{args.concurrency}", f"-d{seconds}s", "--latency",
                 "-s", str(script), server.url + "/v1/chat/completions"],
                capture_output=True, text=True, timeout=seconds + 30, check=True,
            ).stdout  # fmt: skip
            t = tallies[n]
            t.cpu_s += process_tree_cpu_s(server.process.pid) - before
            done = int(_wrk_field(r"(\d+) requests in", out))
            bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
            errors = int(bad.group(1)) if bad else 0
            t.ok += done - errors
            t.errors += errors
            t.wall_s += float(_wrk_field(r"requests in ([\d.]+)s", out))
            p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
            if p50 is not None and t.latencies is not None:
                scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0}[p50.group(2)]
                t.latencies.append(float(p50.group(1)) * scale)


# -- hit rate ---------------------------------------------------------------------------


def replica_gateway_config(
    cluster: SimCluster,
    scaleout: dict[str, Any] | None,
    cold_placement: str = "none",
    picker_file: str | None = None,
) -> dict[str, Any]:
    cfg = gateway_config([{"url": s.url} for s in cluster])
    if scaleout is not None:
        cfg["scaleout"] = scaleout
    if picker_file is not None:
        cfg["picker"] = yaml.safe_load(Path(picker_file).read_text())
    elif cold_placement != "none":
        picker = yaml.safe_load(DEFAULT_PICKER_CONFIG)
        for plugin in picker["plugins"]:
            if plugin["type"] == "prefix-cache-scorer":
                plugin["parameters"] = {"coldPlacement": cold_placement}
        cfg["picker"] = picker
    return cfg


def free_tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def round_robin(
    urls: list[str], workload: Workload, concurrency: int, max_tokens: int
) -> int:
    """Request i goes to gateway i mod len(urls)."""
    return await drive(workload, concurrency, max_tokens, lambda i, _: urls[i % len(urls)])


async def hit_rate_once(
    args: argparse.Namespace, workload: Workload, replicas: int, share: bool
) -> tuple[float, list[int], int]:
    async with SimCluster(args.replicas, base=sim_config(args.num_blocks, args.speed)) as cluster:
        binds = [free_tcp() for _ in range(replicas)]
        runners = []
        for i in range(replicas):
            scaleout = {"bind": binds[i], "peers": binds, "heartbeat_s": 0.2} if share else None
            cfg = replica_gateway_config(cluster, scaleout, args.cold_placement, args.picker)
            runners.append(GatewayRunner(cfg))
        for r in runners:
            await r.__aenter__()
        try:
            for r in runners:
                await wait_ready(r, args.replicas)
            await asyncio.sleep(0.5 if share else 0.0)  # peers subscribed
            before = snapshot(cluster)
            errors = await round_robin([r.url for r in runners], workload, args.concurrency, 8)
            rate, per_replica = totals(cluster, before)
            return rate, per_replica, errors
        finally:
            for r in reversed(runners):
                await r.__aexit__(None, None, None)


async def hit_rates(args: argparse.Namespace) -> None:
    workload = make_workload(args.groups, args.prefix_words, args.requests, None, args.seed)
    setups = [("1 replica", 1, False), ("2 replicas, no sharing", 2, False),
              ("2 replicas, sharing", 2, True)]  # fmt: skip
    results: dict[str, list[tuple[float, list[int], int]]] = {name: [] for name, _, _ in setups}
    for _ in range(args.repeats):
        for name, replicas, share in setups:
            results[name].append(await hit_rate_once(args, workload, replicas, share))
    cache = (args.num_blocks - 1) * 16
    print(
        f"\n### Hit rate: {args.replicas} simulated replicas x {cache} tokens of KV cache, "
        f"{args.groups} prefix groups of {args.prefix_words} words, {args.requests} requests, "
        f"{args.concurrency} clients, round-robin over the gateways, {args.repeats} runs each, "
        f"picker {args.picker or 'default, coldPlacement ' + args.cold_placement}\n"
    )
    print(
        "| setup | hit rate, median (runs) | vs 1 replica (points) | requests per replica (last run) | errors |"
    )
    print("|---|---|---|---|---|")
    base = statistics.median(r[0] for r in results["1 replica"])
    for name, _, _ in setups:
        runs = results[name]
        med = statistics.median(r[0] for r in runs)
        each = ", ".join(f"{r[0]:.1%}" for r in runs)
        print(
            f"| {name} | {med:.1%} ({each}) | {100 * (med - base):+.1f} | {runs[-1][1]} "
            f"| {sum(r[2] for r in runs)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["throughput", "hitrate", "all"], default="all")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument(
        "--client",
        choices=["python", "wrk"],
        default="python",
        help="throughput load generator: this process (aiohttp) or wrk (apt install wrk)",
    )
    parser.add_argument(
        "--cold-placement",
        choices=["none", "hash"],
        default="none",
        help="hit rate: the default profile, or with prefix-cache-scorer coldPlacement: hash",
    )
    parser.add_argument(
        "--picker", help="hit rate: an EndpointPickerConfig file for every gateway (all setups)"
    )
    parser.add_argument("--wrk-seconds", type=float, default=5.0, help="per wrk round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument(
        "--fresh-connections", action="store_true",
        help="a new connection per request (SO_REUSEPORT spreads connections, not requests)",
    )  # fmt: skip
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=600)
    parser.add_argument("--num-blocks", type=int, default=240)
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# bench/scaleout.py — Python {platform.python_version()}, {os.cpu_count()} cores")
    print("command: " + " ".join(["python", *sys.argv]))
    if args.part in ("throughput", "all"):
        asyncio.run(throughput(args))
    if args.part in ("hitrate", "all"):
        hit_args = argparse.Namespace(**vars(args))
        asyncio.run(hit_rates(hit_args))


if __name__ == "__main__":
    main()
