"""Hot-path cost of the latency predictor (not a test).

Per endpoint per decision: `PredictionSource.predictions` (features + two dot
products; with and without reading a prefix scorer for the match) and
`latency-scorer` on top; then one whole `Scheduler.schedule` with the SLO profile of
docs/latency-routing.md against the default profile; and the cost of one learning
update (`LatencyPredictor.completed`, off the decision path). Fresh request objects
each round, so nothing is served from the per-request memo.

    .venv/bin/python bench/latency_predictor.py [--endpoints 100] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time

from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState
from servegate.scheduling.latency.plugins import (
    LatencyScorer,
    LatencyScorerParameters,
    PredictionSource,
)
from servegate.scheduling.latency.predictor import SERVICE_KEY, LatencyPredictor
from servegate.scheduling.prefix.approx import ApproxPrefixParameters, PrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import random_endpoint_states

SLO_PROFILE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- type: slo-headroom-tier-filter
- type: latency-scorer
  parameters: {headroomSelectionStrategy: most}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: predicted-latency-producer}
  - {pluginRef: slo-headroom-tier-filter}
  - {pluginRef: latency-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


def request(rng: random.Random, i: int, slo: bool) -> LLMRequest:
    headers = {"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50"} if slo else {}
    prompt = f"doc {rng.randrange(20)} " + "lorem ipsum " * 300 + f"question {i}"
    return LLMRequest(
        request_id=str(i),
        kind=RequestKind.COMPLETION,
        model="m",
        target_model="m",
        base_model="m",
        prompt=prompt,
        prompt_tokens=len(prompt) // 4,
        headers=headers,
    )


def trained(endpoints: int, seed: int) -> LatencyPredictor:
    predictor = LatencyPredictor()
    rng = random.Random(seed)
    states = random_endpoint_states(endpoints, random.Random(seed))
    for _ in range(500):
        s = rng.choice(states)
        p = predictor.predict(s, rng.randint(50, 4000), rng.random(), None, now=0.0)
        key = predictor.dispatched(s.address, p, now=0.0)
        predictor.completed(s.address, key, p, rng.uniform(50, 900), rng.uniform(10, 60))
    return predictor


def per_call_us(fn: object, rounds: int) -> list[float]:
    out = []
    for i in range(rounds):
        t0 = time.perf_counter_ns()
        fn(i)  # type: ignore[operator]
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    n = args.endpoints
    states = random_endpoint_states(n, random.Random(args.seed))
    predictor = trained(n, args.seed)
    cycle = CycleState(now=1.0, rng=random.Random(args.seed))
    prefix = PrefixCacheScorer("prefix-cache-scorer", ApproxPrefixParameters())
    bare = PredictionSource(predictor)
    with_prefix = PredictionSource(predictor, [prefix])
    scorer = LatencyScorer("l", LatencyScorerParameters(), predictor)
    scorer.source = with_prefix
    reqs = [request(rng, i, slo=True) for i in range(args.rounds)]
    for r in reqs[: args.rounds // 2]:  # some prompts are known somewhere
        prefix.block_keys(r)
    rows = []

    def fresh(i: int) -> LLMRequest:
        r = reqs[i]
        r.cache.clear()
        return r

    rows.append(("predict (features + TTFT/TPOT)", per_call_us(
        lambda i: bare.predictions(cycle, fresh(i), states), args.rounds)))  # fmt: skip
    rows.append(("predict + approximate prefix match", per_call_us(
        lambda i: with_prefix.predictions(cycle, fresh(i), states), args.rounds)))  # fmt: skip
    rows.append(("latency-scorer (predict, prefix, headroom, score)", per_call_us(
        lambda i: scorer.score(cycle, fresh(i), states), args.rounds)))  # fmt: skip
    print(
        f"{n} endpoints, {args.rounds} rounds, trained predictor; Python "
        f"{platform.python_version()} on {platform.machine()}, {sys.platform}\n"
    )
    print("| step | per decision p50 / p99 (µs) | per endpoint p50 (µs) |\n|---|---|---|")
    for name, us in rows:
        q = statistics.quantiles(us, n=100)
        print(f"| {name} | {q[49]:.0f} / {q[98]:.0f} | {q[49] / n:.2f} |")
    print()
    ctx = PluginContext(services={SERVICE_KEY: predictor})
    print("| whole `schedule` call | p50 / p99 (µs) |\n|---|---|")
    for label, doc in (("default profile", DEFAULT_PICKER_CONFIG), ("SLO profile", SLO_PROFILE)):
        schedule = load_picker_config(doc, ctx).schedule
        us = per_call_us(
            lambda i, schedule=schedule: schedule(fresh(i), states, cycle),  # type: ignore[misc]
            args.rounds,
        )
        q = statistics.quantiles(us, n=100)
        print(f"| {label} | {q[49]:.0f} / {q[98]:.0f} |")
    print()
    samples = []
    for i in range(args.rounds):
        s = states[i % n]
        p = predictor.predict(s, 1000, 0.5, None, now=0.0)
        key = predictor.dispatched(s.address, p, now=0.0)
        t0 = time.perf_counter_ns()
        predictor.completed(s.address, key, p, rng.uniform(50, 900), rng.uniform(10, 60))
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    q = statistics.quantiles(samples, n=100)
    print(f"learning update (`completed`, at request end): p50 {q[49]:.0f} µs, p99 {q[98]:.0f} µs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
