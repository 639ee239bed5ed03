from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servegate.bench.engine_counters import (
    EngineCounters,
    EngineDelta,
    engine_url,
    parse_engine_counters,
)

# Real vLLM 0.32 lines (PROTOCOLS.md) plus the counters this module reads.
VLLM_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 12.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 20.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 4.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 6.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters="a1"} 1.79e+09
"""

OLD_VLLM_PAGE = """\
vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 25.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 9.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
"""


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        # queries 12 + 20, hits 4 + 6, requests 3 + 2 (summed over engines and reasons)
        pytest.param(VLLM_PAGE, EngineCounters(10.0, 32.0, 5.0), id="vllm-0.32"),
        pytest.param(OLD_VLLM_PAGE, EngineCounters(25.0, 100.0, 9.0), id="old-names"),
        pytest.param("sglang:num_queue_reqs 3\n", EngineCounters(), id="no-counters"),
    ],
)
def test_parse(page: str, expected: EngineCounters) -> None:
    assert parse_engine_counters(page) == expected


def test_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_engine_counters("this is { not prometheus")


@given(st.text(alphabet=st.sampled_from(list('vlm:_{}="#\n 01.eE+-TYPE')), max_size=80))
def test_any_text_parses_or_raises_value_error(page: str) -> None:
    with contextlib.suppress(ValueError):
        parse_engine_counters(page)


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        # (5-1) + (9-7) hits; (10-2) + (20-10) queries; (4-0) + (6-4) requests
        pytest.param(
            [
                (EngineCounters(1, 2, 0), EngineCounters(5, 10, 4)),
                (EngineCounters(7, 10, 4), EngineCounters(9, 20, 6)),
            ],
            (6.0, 18.0, 6.0, 0),
            id="two-segments",
        ),
        # the counter fell from 50 to 3: the engine restarted, count 3 from zero
        pytest.param(
            [(EngineCounters(50, 60, 10), EngineCounters(3, 4, 1))],
            (3.0, 4.0, 1.0, 0),
            id="restart",
        ),
        pytest.param(
            [(None, EngineCounters(1, 1, 1)), (EngineCounters(1, 1, 1), EngineCounters(2, 3, 4))],
            (1.0, 2.0, 3.0, 1),
            id="failed-scrape-skipped",
        ),
        pytest.param(
            [(EngineCounters(requests=1), EngineCounters(requests=3))],
            (None, None, 2.0, 0),
            id="no-prefix-counters",
        ),
    ],
)
def test_delta(
    segments: list[tuple[EngineCounters | None, EngineCounters | None]],
    expected: tuple[float | None, float | None, float | None, int],
) -> None:
    delta = EngineDelta()
    for before, after in segments:
        delta.add(before, after)
    assert (
        delta.prefix_hits,
        delta.prefix_queries,
        delta.requests,
        delta.failed_scrapes,
    ) == expected


@pytest.mark.parametrize(
    ("given_url", "expected"),
    [
        ("http://h:1", "http://h:1"),
        ("http://h:1/", "http://h:1"),
        ("http://h:1/metrics", "http://h:1"),
    ],
)
def test_engine_url(given_url: str, expected: str) -> None:
    assert engine_url(given_url) == expected
