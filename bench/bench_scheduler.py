"""Microbenchmark of one scheduling decision (not a test).

100 endpoints with random metrics, an 8k-token prompt, N decisions per
configuration; prints p50/p90/p99 microseconds per `Scheduler.schedule` call.
The prompt is new to the pool (no replica holds it), or, in the `held` row, recorded
on 3 replicas first, as the default profile mostly sees it (sticky routing).
Between decisions the chosen endpoint's in-flight count moves, as the gateway's
accounting would, so scores do not stay frozen.

    .venv/bin/python bench/bench_scheduler.py [--n 20000] [--endpoints 100]
    .venv/bin/python bench/bench_scheduler.py --endpoints 50,100,250,500,1000 --n 5000 \
        --exhaustive --plot docs/img/scheduler-scaling.png

`--exhaustive` adds a row per configuration with the shortlist turned off (every
candidate scored), the way one decision cost before pools were shortlisted.
`--against DIR` times another checkout's scheduler (DIR/src) side by side: each
row runs in a fresh process per checkout, alternating, `--rounds` times.

`--routing` times instead the whole per-request routing work the gateway does around
the default profile's decision (`CacheRouting.prepare`, `Scheduler.schedule`,
`GatewayMetrics.observe_pick`, `Scheduler.pre_request`, `DecisionLog.record`,
`CacheRouting.headers`) for a 1.5 kB chat prompt parsed anew per request (so its block
keys are hashed per request, as in production), 16 requests in flight: the same prompt
each time (held by the replicas it was sent to, the gateway-overhead bench's traffic), or a
new one each time.

    .venv/bin/python bench/bench_scheduler.py --routing --endpoints 2,8,100,1000,3000 \
        --n 5000 --against /path/to/other/checkout --clock cpu --rounds 3

    .venv/bin/python bench/bench_scheduler.py --endpoints 2,8,100,1000 --n 3000 \
        --against /path/to/other/checkout --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from servegate.pool.endpoint import EndpointState, LoraInfo, Role
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import random_endpoint_states

HEAVY_PICKER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: label-selector-filter
  parameters:
    matchExpressions:
    - {key: llm-d.ai/role, operator: NotIn, values: [prefill]}
- type: decode-filter
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: token-load-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: label-selector-filter}
  - {pluginRef: decode-filter}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 2}
  - {pluginRef: token-load-scorer, weight: 1}
  - {pluginRef: lora-affinity-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""

CONFIGS = {
    "default (servegate default profile)": (DEFAULT_PICKER_CONFIG, None, 0),
    "default, prompt held by 3 replicas": (DEFAULT_PICKER_CONFIG, None, 3),
    "heavy (2 filters, 5 scorers, LoRA request)": (HEAVY_PICKER_CONFIG, "a3", 0),
}
"""label → (picker config, LoRA adapter of the request, replicas that hold its prompt)."""

ROUTING_ROWS = {
    "routing, 1.5 kB prompt sent again": False,
    "routing, 1.5 kB prompt new each time": True,
}
"""`--routing` rows: label → whether each request's prompt is new to the pool."""


def _request(lora: str | None) -> LLMRequest:
    prompt = "lorem ipsum dolor sit amet " * 1200  # ~32k characters ≈ 8k tokens
    model = lora or "base"
    return LLMRequest(
        request_id="bench",
        kind=RequestKind.CHAT,
        model=model,
        target_model=model,
        base_model="base",
        lora=lora,
        prompt=prompt,
        messages=[{"role": "user", "content": prompt}],
        prompt_tokens=8192,
        max_tokens=256,
    )


def run(
    config: str,
    lora: str | None,
    n: int,
    endpoints: int,
    seed: int,
    exhaustive: bool = False,
    clock: str = "wall",
    warm: int = 0,
) -> list[float]:
    rng = random.Random(seed)
    scheduler = load_picker_config(config, PluginContext(staleness_s=2.0))
    if exhaustive:
        scheduler.exhaustive_limit = 1 << 30
    states = random_endpoint_states(
        endpoints, rng, now=100.0, roles=[Role.DECODE, Role.BOTH, Role.DECODE, Role.BOTH]
    )
    for s in states:
        running = frozenset(rng.sample(["a1", "a2", "a3", "a4"], rng.randint(0, 2)))
        s.metrics.lora = LoraInfo(max_lora=2, running=running)
    request = _request(lora)
    for state in rng.sample(states, min(warm, endpoints)):  # as if routed there before
        scheduler.pre_request(request, Decision(endpoint=state, fallbacks=[]), now=99.0)
    cycle_rng = random.Random(seed + 1)
    perf = time.perf_counter_ns if clock == "wall" else time.thread_time_ns
    samples: list[float] = []
    for i in range(n + n // 10):
        cycle = CycleState(now=100.0 + i * 1e-3, rng=cycle_rng)
        t0 = perf()
        decision = scheduler.schedule(request, states, cycle)
        elapsed = perf() - t0
        if i >= n // 10:  # warm-up excluded
            samples.append(elapsed / 1000.0)
        decision.endpoint.in_flight_requests += 1
        decision.endpoint.in_flight_tokens += 8448
        done = states[rng.randrange(endpoints)]
        done.in_flight_requests = max(0, done.in_flight_requests - 1)
        done.in_flight_tokens = max(0, done.in_flight_tokens - 8448)
    return samples


CONCURRENCY = 16
"""`--routing`: requests in flight at once, as in the gateway-overhead bench's `-c 16`; each
decision's request completes when the 17th after it is routed (first in, first out)."""


def run_routing(
    n: int, endpoints: int, seed: int, clock: str = "wall", fresh: bool = False
) -> list[float]:
    """The gateway's per-request routing work around one default-profile decision, timed
    together (the Director's calls, in its order, without its I/O and its own metrics)."""
    from servegate.gateway.cache_routing import CacheRouting
    from servegate.gateway.metrics import GatewayMetrics
    from servegate.gateway.ui import DecisionLog
    from servegate.scheduling.affinity import ResponseHeaders

    rng = random.Random(seed)
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext(staleness_s=2.0))
    states = random_endpoint_states(endpoints, rng, now=100.0)
    for s in states:  # only this bench's own requests in flight (the gateway's counters)
        s.in_flight_requests = s.in_flight_tokens = 0
    in_flight: deque[tuple[EndpointState, int]] = deque()
    metrics = GatewayMetrics()
    decisions = DecisionLog()
    headers = tuple(p for p in scheduler.plugins.values() if isinstance(p, ResponseHeaders))
    routing = CacheRouting(header_plugins=headers)
    text = "You are a helpful assistant. Summarise the following text. " + "lorem ipsum " * 120
    cycle_rng = random.Random(seed + 1)
    perf = time.perf_counter_ns if clock == "wall" else time.thread_time_ns
    samples: list[float] = []
    for i in range(n + n // 10):
        prompt = f"{i} {text}" if fresh else text
        request = LLMRequest(
            request_id=f"r{i}",
            kind=RequestKind.CHAT,
            model="base",
            target_model="base",
            base_model="base",
            prompt=prompt,
            messages=[{"role": "user", "content": prompt}],
            prompt_tokens=len(prompt) // 4,
            max_tokens=64,
        )
        extra: dict[str, str] = {}
        now = 100.0 + i * 1e-3
        t0 = perf()
        prepare = routing.prepare(request, states)
        try:
            prepare.send(None)
        except StopIteration:
            pass
        cycle = CycleState(now=now, rng=cycle_rng)
        decision = scheduler.schedule(request, states, cycle)
        metrics.observe_pick("pool", decision)
        scheduler.pre_request(request, decision, now)
        decisions.record("pool", request, decision, now)
        routing.headers(request, decision, extra)
        elapsed = perf() - t0
        if i >= n // 10:  # warm-up excluded
            samples.append(elapsed / 1000.0)
        picked = decision.endpoint
        picked.in_flight_requests += 1
        picked.in_flight_tokens += request.prompt_tokens
        in_flight.append((picked, request.prompt_tokens))
        if len(in_flight) > CONCURRENCY:  # the oldest request completes
            done, tokens = in_flight.popleft()
            done.in_flight_requests -= 1
            done.in_flight_tokens -= tokens
    return samples


def _quantiles(samples: list[float]) -> tuple[float, float, float, float]:
    q = statistics.quantiles(sorted(samples), n=100)
    return q[49], q[89], q[98], statistics.fmean(samples)


def _in_process(
    src: Path, label: str, size: int, args: argparse.Namespace, exhaustive: bool
) -> tuple[float, float, float, float]:
    """One row timed in a fresh interpreter that imports servegate from `src`."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        label,
        "--endpoints",
        str(size),
        "--n",
        str(args.n),
        "--seed",
        str(args.seed),
        "--clock",
        args.clock,
    ]
    if exhaustive:
        cmd.append("--exhaustive")
    if args.routing:
        cmd.append("--routing")
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    p50, p90, p99, mean = json.loads(done.stdout)
    return p50, p90, p99, mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="decisions per configuration")
    parser.add_argument(
        "--endpoints", default="100", help="pool size, or a comma-separated list of sizes"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--exhaustive", action="store_true", help="also time scoring every candidate"
    )
    parser.add_argument("--plot", help="write a PNG of p50 decision time against pool size")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time (steadier on a shared, busy machine)",
    )
    parser.add_argument(
        "--against", type=Path, help="another checkout to time side by side (its src/)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations with --against")
    parser.add_argument(
        "--labels",
        default="this,against",
        help="with --against: names of this checkout and the other in the plot",
    )
    parser.add_argument(
        "--routing",
        action="store_true",
        help="time the whole per-request routing work (1.5 kB prompt) instead of one decision",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in str(args.endpoints).split(",")]
    if args.worker and args.routing:
        fresh = ROUTING_ROWS[args.worker]
        print(json.dumps(_quantiles(run_routing(args.n, sizes[0], args.seed, args.clock, fresh))))
        return 0
    if args.worker:
        config, lora, warm = CONFIGS[args.worker]
        samples = run(config, lora, args.n, sizes[0], args.seed, args.exhaustive, args.clock, warm)
        print(json.dumps(_quantiles(samples)))
        return 0
    print(
        f"python {platform.python_version()} on {platform.machine()}; "
        f"{args.n} decisions each, "
        f"{'1.5 kB' if args.routing else '8k-token'} prompt, {args.clock} clock"
    )
    modes = [False, True] if args.exhaustive else [False]
    p50: dict[str, list[float]] = {}
    if args.against is not None:
        _compare(args, sizes, modes, p50)
    elif args.routing:
        for size in sizes:
            for label, fresh in ROUTING_ROWS.items():
                q50, q90, q99, mean = _quantiles(
                    run_routing(args.n, size, args.seed, args.clock, fresh)
                )
                p50.setdefault(label, []).append(q50)
                print(
                    f"{size:5d} ep  {label:57s} p50 {q50:7.1f} µs   p90 {q90:7.1f} µs"
                    f"   p99 {q99:7.1f} µs   mean {mean:7.1f} µs"
                )
    else:
        for size in sizes:
            for label, (config, lora, warm) in CONFIGS.items():
                for exhaustive in modes:
                    row = f"{label}{' exhaustive' if exhaustive else ''}"
                    samples = run(
                        config, lora, args.n, size, args.seed, exhaustive, args.clock, warm
                    )
                    q50, q90, q99, mean = _quantiles(samples)
                    p50.setdefault(row, []).append(q50)
                    print(
                        f"{size:5d} ep  {row:57s} p50 {q50:7.1f} µs   p90 {q90:7.1f} µs"
                        f"   p99 {q99:7.1f} µs   mean {mean:7.1f} µs"
                    )
    if args.plot:
        _plot(
            args.plot,
            sizes,
            p50,
            str(args.labels).split(",") if args.against else [],
            "The per-request routing work" if args.routing else "One scheduling decision",
        )
    return 0


def _side_by_side(label: str, theirs: list[float], ours: list[float], ratio: float) -> str:
    """One `--against` line: each round's figure for both checkouts, and their ratio."""
    return (
        f"{label} against "
        + " / ".join(f"{x:6.1f}" for x in theirs)
        + " µs, this "
        + " / ".join(f"{x:6.1f}" for x in ours)
        + f" µs   this ÷ against {ratio:.2f}"
    )


def _compare(
    args: argparse.Namespace, sizes: list[int], modes: list[bool], p50: dict[str, list[float]]
) -> None:
    """Each row in both checkouts, alternating; p50s per round and their medians' ratio."""
    here = Path(__file__).resolve().parent.parent / "src"
    there = args.against.resolve() / "src"
    this_label, that_label = str(args.labels).split(",")
    print(f"this checkout: {here}\nagainst:       {there}  ({args.rounds} rounds)")
    labels = list(ROUTING_ROWS) if args.routing else list(CONFIGS)
    for size in sizes:
        for label in labels:
            for exhaustive in modes:
                row = f"{label}{' exhaustive' if exhaustive else ''}"
                ours: list[float] = []
                theirs: list[float] = []
                our_means: list[float] = []
                their_means: list[float] = []
                for _ in range(args.rounds):
                    there_row = _in_process(there, label, size, args, exhaustive)
                    here_row = _in_process(here, label, size, args, exhaustive)
                    theirs.append(there_row[0])
                    ours.append(here_row[0])
                    their_means.append(there_row[3])
                    our_means.append(here_row[3])
                a, b = statistics.median(theirs), statistics.median(ours)
                p50.setdefault(f"{row}, {that_label}", []).append(a)
                p50.setdefault(f"{row}, {this_label}", []).append(b)
                print(_side_by_side(f"{size:5d} ep  {row:57s} p50", theirs, ours, b / a))
                # a p50 can sit between two modes (the affinity filter sticky in about half
                # the decisions and not in the rest): the mean says which way the row moved
                ma, mb = statistics.median(their_means), statistics.median(our_means)
                print(_side_by_side(f"{'':9s}{'':57s} mean", their_means, our_means, mb / ma))


def _plot(
    path: str,
    sizes: list[int],
    p50: dict[str, list[float]],
    labels: list[str],
    what: str = "One scheduling decision",
) -> None:
    """One line per row; a row's checkouts (`labels`: this, against) and its exhaustive
    variant share a colour; the other checkout is dashed, exhaustive scoring dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours: dict[str, str] = {}
    for row, values in p50.items():
        group = row.replace(" exhaustive", "")
        for label in labels:
            group = group.removesuffix(f", {label}")
        style = "--" if labels and row.endswith(f", {labels[-1]}") else "-"
        ax.plot(
            sizes,
            values,
            marker="o",
            color=colours.setdefault(group, f"C{len(colours)}"),
            linestyle=":" if "exhaustive" in row else style,
            label=row,
        )
    ax.axhline(100, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    if any("exhaustive" in row for row in p50):
        ax.set_yscale("log")  # exhaustive scoring grows linearly, to milliseconds
    ax.set_xlabel("endpoints in the pool")
    ax.set_ylabel("p50 time (µs)")
    ax.set_title(f"{what} against pool size (bench/bench_scheduler.py)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
