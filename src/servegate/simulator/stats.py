"""What the engine counts, as plain data; `metrics.py` renders it per persona.

The hot path only does integer and float arithmetic here (no locks, no label
lookups); the Prometheus families are built when `/metrics` is scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class Histogram:
    """Bucket counts (not cumulative) plus sum; the last count is the +Inf overflow."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """`(le, cumulative count)` pairs ending with `+Inf`, for exposition."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((_fmt_le(bound), float(running)))
        out.append(("+Inf", float(running + self.counts[-1])))
        return out


def _fmt_le(bound: float) -> str:
    return repr(float(bound))


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters and distributions since the engine started."""

    prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token (vLLM's counter)."""
    generation_tokens: int = 0
    """Tokens generated."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache when a request was scheduled."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served without computing them (prefix hits and remote KV)."""
    preemptions: int = 0
    requests_received: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    """Finished requests by finish reason."""
    steps: int = 0
    last_step_s: float = 0.0
    busy_s: float = 0.0
    """Simulated time spent in steps."""
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inference_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    request_prompt_tokens: Histogram = field(default_factory=lambda: Histogram((1,)))
    request_generation_tokens: Histogram = field(default_factory=lambda: Histogram((1,)))
    lora_info: dict[tuple[str, str], float] = field(default_factory=dict)
    """vLLM's `lora_requests_info` series: (running, waiting) adapter lists -> last time set."""

    @classmethod
    def for_model_len(cls, max_model_len: int) -> EngineStats:
        buckets = one_two_five_buckets(max_model_len)
        return cls(
            request_prompt_tokens=Histogram(buckets),
            request_generation_tokens=Histogram(buckets),
        )

    def record_lora(self, running: str, waiting: str, now: float, keep: int = 64) -> None:
        info = self.lora_info
        info.pop((running, waiting), None)
        info[(running, waiting)] = now
        if len(info) > keep:
            del info[next(iter(info))]
