"""Aggregated vs disaggregated (prefill/decode) serving on simulated vLLM replicas (not a test).

    .venv/bin/python bench/bench_disagg.py                          # rates 8 and 16 req/s
    .venv/bin/python bench/bench_disagg.py --rates 8 --requests 80  # a quick look

The same four simulated replicas (one child process each), the same requests at the
same Poisson arrival times, behind an in-process gateway, in two setups:

- aggregated: four `prefill-decode` replicas, one profile (prefix affinity, queue,
  in-flight requests);
- disaggregated: two `prefill` and two `decode` replicas, `disagg-profile-handler`
  with `prefix-based-pd-decider` (`nonCachedTokens` 256), the gateway running both
  legs with vLLM's NIXL `kv_transfer_params` (the simulator honours them: the decode
  replica is charged no prefill for transferred blocks).

Workload: `--long-share` of the requests are new documents of about `--prompt-words`
words, the rest short questions of about 30 words; every request streams
`--output-tokens` tokens (`ignore_eos`). Reported: client-side time to first token and
inter-token gaps (and the share of gaps over 40 ms: a stream stalled behind a prefill),
output throughput, the gateway's P/D decisions, and from the
replicas' own `/metrics` the prompt tokens each role computed
(`iteration_tokens_sum − generation_tokens + finished requests`).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from servegate.bench.client import RequestResult, send_request
from servegate.bench.stats import percentile
from servegate.bench.text import words
from servegate.bench.workloads import BenchRequest
from servegate.testing.cluster import SimClusterProcess
from servegate.testing.gateway import GatewayRunner

MODEL = "sim-model"
STALL_S = 0.04
"""An inter-token gap this long means the stream waited for someone's prefill."""
HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
SIM = {
    "model": MODEL,
    "speed": 1.0,
    "num_blocks": 2049,
    "block_size": 16,
    "max_model_len": 8192,
}
AGGREGATED = {
    **HEAD,
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "active-request-scorer"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 1},
            ],
        }
    ],
}
DISAGGREGATED = {
    **HEAD,
    "plugins": [
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "active-request-scorer"},
        {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 256}},
        {
            "type": "disagg-profile-handler",
            "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}},
        },
    ],
    "schedulingProfiles": [
        {
            "name": "prefill",
            "plugins": [
                {"pluginRef": "prefill-filter"},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 1},
            ],
        },
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 1},
            ],
        },
    ],
}


@dataclass(frozen=True)
class Setup:
    name: str
    roles: tuple[str, ...]
    picker: dict[str, Any]


SETUPS = (
    Setup("aggregated", ("prefill-decode",) * 4, AGGREGATED),
    Setup("disaggregated", ("prefill", "prefill", "decode", "decode"), DISAGGREGATED),
)


@dataclass(frozen=True)
class Row:
    setup: str
    rate: float
    results: list[RequestResult]
    wall_s: float
    decisions: Counter[str]
    computed: dict[str, float]
    """Prompt tokens computed, by replica role."""


def workload(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        if rng.random() < args.long_share:
            prompt = f"Document {i}. " + words(rng, args.prompt_words) + "\nSummarise it."
        else:
            prompt = f"Question {i}: " + words(rng, 30) + "?"
        out.append(BenchRequest(model=MODEL, max_tokens=args.output_tokens, prompt=prompt))
    return out


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def engine_work(http: aiohttp.ClientSession, url: str) -> float:
    """Prompt tokens this replica computed so far (see the module docstring)."""
    async with http.get(url + "/metrics") as resp:
        page = await resp.text()
    sums: Counter[str] = Counter()
    wanted = {
        "vllm:iteration_tokens_total_sum",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    }
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] += sample.value
    return (
        sums["vllm:iteration_tokens_total_sum"]
        - sums["vllm:generation_tokens_total"]
        + sums["vllm:request_success_total"]
    )


async def run_setup(setup: Setup, rate: float, requests: list[BenchRequest], seed: int) -> Row:
    overrides = [{"role": role} for role in setup.roles]
    async with (
        SimClusterProcess(len(setup.roles), base=SIM, overrides=overrides) as sims,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        cfg = {
            "gateway": {"seed": seed, "port": 0},
            "disaggregation": {"mode": "gateway"},
            "pool": {
                "scrape_interval_s": 0.05,
                "health": {"interval_s": 0.5, "timeout_s": 2.0},
                "endpoints": [
                    {"url": url, "role": role}
                    for url, role in zip(sims.urls, setup.roles, strict=True)
                ],
            },
            "picker": setup.picker,
        }
        async with GatewayRunner(cfg) as gw:
            pool = gw.gateway.pool
            deadline = time.monotonic() + 30
            while pool.ready_count() < len(setup.roles) or pool.resolve_model(MODEL) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the simulated replicas did not become ready")
                await asyncio.sleep(0.05)
            before = [await engine_work(http, url) for url in sims.urls]
            offsets = arrivals(len(requests), rate, seed)
            start = time.perf_counter()

            async def one(request: BenchRequest, at: float) -> RequestResult:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                return await send_request(http, gw.url, request, stream=True, ignore_eos=True)

            results = await asyncio.gather(
                *(one(r, at) for r, at in zip(requests, offsets, strict=True))
            )
            wall = time.perf_counter() - start
            after = [await engine_work(http, url) for url in sims.urls]
            decisions = Counter(
                line["pd_decision"] or "single-profile" for line in gw.access_lines()
            )
    computed: Counter[str] = Counter()
    for role, b, a in zip(setup.roles, before, after, strict=True):
        computed[role] += a - b
    return Row(setup.name, rate, list(results), wall, decisions, dict(computed))


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def table(rows: list[Row]) -> str:
    head = (
        "| setup | rate (req/s) | ok | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 / p99.9 (ms) | "
        f"gaps > {STALL_S * 1000:.0f} ms | output tok/s | P/D decisions | "
        "prompt tokens computed (prefill / decode-capable) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        ok = [r for r in row.results if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        itl = [g for r in ok for g in r.itl_s]
        tokens = sum(r.output_tokens for r in ok)
        stalls = sum(1 for g in itl if g > STALL_S)
        decided = ", ".join(f"{k} {v}" for k, v in sorted(row.decisions.items()))
        prefill = row.computed.get("prefill", 0.0)
        decoding = row.computed.get("decode", 0.0) + row.computed.get("prefill-decode", 0.0)
        lines.append(
            f"| {row.setup} | {row.rate:g} | {len(ok)}/{len(row.results)} | "
            f"{_ms(percentile(ttft, 50))} / {_ms(percentile(ttft, 90))} / "
            f"{_ms(percentile(ttft, 99))} | {_ms(percentile(itl, 50))} / "
            f"{_ms(percentile(itl, 99))} / {_ms(percentile(itl, 99.9))} | "
            f"{stalls / max(1, len(itl)):.2%} | {tokens / row.wall_s:.0f} | {decided} | "
            f"{prefill:.0f} / {decoding:.0f} |"
        )
    return head + "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    requests = workload(args)
    rows = []
    for rate in args.rates:
        for setup in SETUPS:
            row = await run_setup(setup, rate, requests, args.seed)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    print()
    print(
        f"{args.requests} requests per run ({args.long_share:.0%} documents of "
        f"{args.prompt_words} words, the rest ~30 words), {args.output_tokens} output tokens, "
        f"seed {args.seed}; Python {platform.python_version()} on {platform.machine()}, "
        f"{sys.platform}"
    )
    print(table(rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[8, 16])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--long-share", type=float, default=0.7)
    p.add_argument("--prompt-words", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
