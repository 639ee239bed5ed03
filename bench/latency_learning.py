"""Per-request cost of the gateway's latency bookkeeping: dispatch and learning (not a test).

What every request pays in `LatencyRouting` outside the scheduling call, whatever
the profile: `dispatch` (the chosen endpoint's prediction, the access-record fields,
the backlog entry, the `Ticket`), then for a stream the TTFT learned at its first byte
(`learn_first_tokens`, as `admit` runs it before the next decision) and the TPOT
learned at its end (`Ticket.done`); a JSON answer's `done` only releases its backlog.
Requests go to `--endpoints` replicas through the default profile's real scheduler
(untimed), `--in-flight` at a time on a virtual clock, so the backlog and the fits
look like a loaded gateway's. Each phase is timed per call; the figure is the mean
per request over a round, and the median of `--rounds` rounds is printed.

    .venv/bin/python bench/latency_learning.py
    .venv/bin/python bench/latency_learning.py --against base=/work/ref-base/src
    .venv/bin/python bench/latency_learning.py --interval 0.0002   # 5,000 requests/s

`--interval` sets the virtual clock's step between requests. The default profile's
prefix affinity sends nearly all of them to one endpoint, so the default (5 ms: 200
streams a second there) is over the predictor's default learning cap (`learn_per_s`,
100): about half the streams are learned; 20 ms (50 a second) is under it, 0.2 ms far
over it. The last column is the share of ended streams the predictor learned from.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import orjson

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.latency import LatencyRouting, Ticket
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState
from servegate.scheduling.latency.predictor import SERVICE_KEY, LatencyPredictor
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import random_endpoint_states

PHASES = ("dispatch", "first_token", "done")


def _request(rng: random.Random, i: int, stream: bool) -> LLMRequest:
    prompt = f"system {rng.randrange(8)} " + "lorem ipsum " * 120 + f"question {i}"
    return LLMRequest(
        request_id=str(i),
        kind=RequestKind.CHAT,
        model="m",
        target_model="m",
        base_model="m",
        prompt=prompt,
        prompt_tokens=len(prompt) // 4,
        stream=stream,  # what the request asked for: a stream is sampled at its dispatch
        headers={},
    )


def measure(
    stream: bool, requests: int, endpoints: int, in_flight: int, seed: int, interval: float
) -> dict[str, float]:
    """Mean µs per request of each phase over `requests` requests (after as many warm-up)."""
    rng = random.Random(seed)
    states = random_endpoint_states(endpoints, random.Random(seed))
    predictor = LatencyPredictor()
    picker = load_picker_config(
        DEFAULT_PICKER_CONFIG, PluginContext(services={SERVICE_KEY: predictor})
    )
    routing = LatencyRouting(predictor, picker.plugins)
    learn_first_tokens: Callable[[float], None] = (
        routing.learn_first_tokens
        if "now" in inspect.signature(routing.learn_first_tokens).parameters
        else lambda _now: routing.learn_first_tokens()  # type: ignore[call-arg]  # a checkout without the learning cap
    )
    reqs = [_request(rng, i, stream) for i in range(2 * requests)]
    open_: deque[tuple[Ticket, AccessRecord, float]] = deque()
    spent = dict.fromkeys(PHASES, 0)
    now = 100.0
    perf = time.perf_counter_ns
    for i, req in enumerate(reqs):
        timed = i >= requests
        now += interval
        cycle = CycleState(now=now, rng=rng)
        decision = picker.schedule(req, states, cycle)
        record = AccessRecord(request_id=req.request_id, method="POST", path="/v1/chat/completions")
        t0 = perf()
        ticket = routing.dispatch(req, decision, record, cycle, now - 0.001)
        t1 = perf()
        open_.append((ticket, record, now))
        record.endpoint, record.status, record.stream = (
            decision.endpoint.endpoint.address,
            200,
            stream,
        )
        if len(open_) > in_flight:
            ticket, record, sent = open_.popleft()
            record.ttft_ms = 1.0 + 40.0 * (1.0 + rng.random()) * (1 + i % 3)
            t2 = perf()
            learn_first_tokens(now)
            t3 = perf()
            record.completion_tokens = 16
            t4 = perf()
            ticket.done(record, sent + 0.2 + 0.05 * rng.random())
            t5 = perf()
            if timed:
                spent["first_token"] += t3 - t2
                spent["done"] += t5 - t4
        if timed:
            spent["dispatch"] += t1 - t0
    out = {phase: ns / requests / 1000.0 for phase, ns in spent.items()}
    learned = sum(m.ttft_error.observations for m in predictor.endpoints.values())
    out["learned"] = learned / (2 * requests - in_flight)  # of the streams that ended
    return out


def child(args: argparse.Namespace) -> None:
    out = {
        kind: measure(
            kind == "sse", args.requests, args.endpoints, args.in_flight, args.seed, args.interval
        )
        for kind in ("json", "sse")
    }
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


def main(args: argparse.Namespace) -> None:
    variants = [("this tree", None), *(tuple(a.split("=", 1)) for a in args.against)]
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, _ in variants}
    here = [sys.executable, __file__, "--child", "--requests", str(args.requests),
            "--endpoints", str(args.endpoints), "--in-flight", str(args.in_flight),
            "--seed", str(args.seed), "--interval", str(args.interval)]  # fmt: skip
    for _ in range(args.rounds):
        for name, src in variants:
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = str(Path(src).resolve())
            done = subprocess.run(here, env=env, capture_output=True, text=True, check=True)
            runs[name].append(orjson.loads(done.stdout))
    print(
        f"{args.endpoints} endpoints, {args.in_flight} in flight, one request every "
        f"{args.interval * 1000:g} ms ({1 / args.interval:g}/s in all; the default profile's "
        "prefix affinity sends most to one endpoint), "
        f"{args.requests} timed requests per round, median of {args.rounds} rounds "
        "(µs per request)\n"
    )
    header = "| variant | kind | " + " | ".join(PHASES) + " | total | streams learned |"
    print(header + "\n" + "|---" * (len(PHASES) + 4) + "|")
    medians: dict[tuple[str, str], float] = {}
    for name, _ in variants:
        for kind in ("json", "sse"):
            cells = [statistics.median(r[kind][p] for r in runs[name]) for p in PHASES]
            total = statistics.median(sum(r[kind][p] for p in PHASES) for r in runs[name])
            learned = statistics.median(r[kind]["learned"] for r in runs[name])
            medians[name, kind] = total
            print(
                f"| {name} | {kind} | "
                + " | ".join(f"{c:.2f}" for c in cells)
                + f" | {total:.2f} | {learned:.0%} |"
            )
    for name, _ in variants[1:]:
        for kind in ("json", "sse"):
            ratio = medians[name, kind] / medians["this tree", kind]
            print(f"{kind}: {name} / this tree = {ratio:.2f}×")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--endpoints", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--interval",
        type=float,
        default=0.005,
        help="virtual seconds between requests (0.0002: 5,000/s, far over the learning cap)",
    )
    p.add_argument("--against", action="append", default=[], metavar="NAME=SRC")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    child(a) if a.child else main(a)
