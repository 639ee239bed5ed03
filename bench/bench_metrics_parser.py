"""Time servegate's metrics parser against prometheus_client's on the fixture pages.

    .venv/bin/python bench/bench_metrics_parser.py [--iterations N]

For every captured page (tests/fixtures/metrics/*.txt) it prints the median and
p99 time of one `MetricsParser.parse` call in steady state (the parser is reused,
as the scraper reuses it, so label sets seen before come from its cache), the
first parse of a newly built parser (cold: every label set parsed), and
`prometheus_client.parser.text_string_to_metric_families` consuming the whole
page. The design budget is 100 µs per vLLM page.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from servegate.datalayer.metrics_parser import MetricsParser
from servegate.engines import EngineSpec, builtin_engines

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "metrics"
PAGES = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "trtllm-serve",
    "triton": "triton-tensorrt-llm",
}
BUDGET_US = 100.0


def timings(call: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(min(50, iterations)):
        call()
    out = []
    gc.disable()
    try:
        for _ in range(iterations):
            start = time.perf_counter_ns()
            call()
            out.append((time.perf_counter_ns() - start) / 1000)
    finally:
        gc.enable()
    return sorted(out)


def summary(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def measure(spec: EngineSpec, text: str, iterations: int) -> list[tuple[float, float]]:
    warm = MetricsParser(spec)
    fresh = iter([MetricsParser(spec) for _ in range(iterations + 50)])
    return [
        summary(timings(lambda: warm.parse(text, 0.0), iterations)),
        summary(timings(lambda: next(fresh).parse(text, 0.0), iterations)),
        summary(timings(lambda: list(text_string_to_metric_families(text)), iterations // 10 or 1)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    args = parser.parse_args()
    engines = builtin_engines()
    header = (
        f"{'page':<8}{'lines':>7}{'bytes':>8}   {'servegate med/p99 µs':>21}"
        f"   {'cold med/p99 µs':>16}   {'prometheus_client med/p99 µs':>29}   {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    for fixture, engine in PAGES.items():
        text = (FIXTURES / f"{fixture}.txt").read_text()
        ours, cold, reference = measure(engines[engine], text, args.iterations)
        print(
            f"{fixture:<8}{text.count(chr(10)):>7}{len(text.encode()):>8}"
            f"   {ours[0]:>10.1f} /{ours[1]:>8.1f}"
            f"   {cold[0]:>7.1f} /{cold[1]:>6.1f}"
            f"   {reference[0]:>18.1f} /{reference[1]:>8.1f}"
            f"   {reference[0] / ours[0]:>7.0f}x"
        )
    print(f"\nbudget: {BUDGET_US:.0f} µs per vLLM page (DESIGN.md)")


if __name__ == "__main__":
    main()
