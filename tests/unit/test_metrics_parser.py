from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from servegate.datalayer.metrics_parser import MetricsParser, parse_labels
from servegate.engines import SIGNALS, Aggregation, EngineSpec, MetricSpec, builtin_engines
from servegate.pool.endpoint import EndpointMetrics, LoraInfo

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
REAL_PAGES = {"held": "vllm_metrics.txt", "idle": "vllm_metrics_idle.txt"}
"""Pages recorded from real vLLM 0.32 (scripts/record_fixtures.py); signals in vllm_metrics.json."""
ENGINES = builtin_engines()
PAGES = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "trtllm-serve",
    "triton": "triton-tensorrt-llm",
}


def page(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


def parse(engine: str, text: str) -> EndpointMetrics:
    return MetricsParser(ENGINES[engine]).parse(text, now=42.0).metrics


# -- the reference: prometheus_client's parser plus the spec's semantics, written plainly --


def reference_series(
    text: str, names: tuple[str, ...]
) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def reference_value(
    source: MetricSpec, series: dict[str, list[tuple[dict[str, str], float]]]
) -> float | None:
    chosen: list[tuple[dict[str, str], float]] = []
    for name in source.names:
        chosen = [
            s for s in series.get(name, []) if all(s[0].get(k) == v for k, v in source.labels)
        ]
        if chosen:
            break
    values: list[float] = []
    for labels, value in chosen:
        if source.label is None:
            values.append(value)
        elif labels.get(source.label, "None") != "None":
            values.append(float(labels[source.label]))
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    result = {
        Aggregation.SUM: sum(values),
        Aggregation.MEAN: sum(values) / len(values),
        Aggregation.MAX: max(values),
        Aggregation.LATEST_BY_VALUE: max(values),
    }[source.aggregation]
    if source.per is not None:
        divisor = reference_value(source.per, series)
        return None if not divisor else result / divisor
    return result


def reference_metrics(spec: EngineSpec, text: str) -> dict[str, object]:
    series = reference_series(text, spec.families())
    out: dict[str, object] = {}
    for signal in SIGNALS:
        value: object = None
        for source in spec.signal(signal):
            if signal == "lora":
                rows = [s for name in source.names for s in series.get(name, [])]
                if rows:
                    labels = max(rows, key=lambda s: s[1])[0]
                    value = LoraInfo(
                        int(labels["max_lora"]),
                        frozenset(a for a in labels["running_lora_adapters"].split(",") if a),
                        frozenset(a for a in labels["waiting_lora_adapters"].split(",") if a),
                    )
            else:
                value = reference_value(source, series)
            if value is not None:
                break
        out[signal] = value
    return out


def as_dict(metrics: EndpointMetrics) -> dict[str, object]:
    return {signal: getattr(metrics, signal) for signal in SIGNALS}


@pytest.mark.parametrize(("fixture", "engine"), PAGES.items(), ids=list(PAGES))
def test_series_equal_prometheus_client(fixture: str, engine: str) -> None:
    text = page(fixture)
    parser = MetricsParser(ENGINES[engine])
    found, malformed = parser.scan(text)
    assert malformed == 0
    assert found == reference_series(text, parser.families)
    assert found, "the fixture must contain the engine's families"


@pytest.mark.parametrize(("fixture", "engine"), PAGES.items(), ids=list(PAGES))
def test_signals_equal_prometheus_client(fixture: str, engine: str) -> None:
    text = page(fixture)
    expected = reference_metrics(ENGINES[engine], text)
    result = MetricsParser(ENGINES[engine]).parse(text, now=42.0)
    got = as_dict(result.metrics)
    for signal in ("waiting", "running", "kv_usage"):
        expected[signal] = expected[signal] or 0.0
    for signal in ("block_size", "num_blocks"):
        value = expected[signal]
        expected[signal] = int(value) if isinstance(value, float) else None
    assert got == expected
    assert result.metrics.scraped_at == 42.0


@pytest.mark.parametrize(
    ("fixture", "engine", "expected"),
    [
        pytest.param(
            "vllm",
            "vllm",
            EndpointMetrics(
                waiting=0.0,
                running=0.0,
                kv_usage=0.0,
                block_size=32,
                num_blocks=128,
                # the series with running_lora_adapters="" has the larger timestamp value
                lora=LoraInfo(max_lora=2, running=frozenset(), waiting=frozenset()),
                prefix_cache_queries=12.0,
                prefix_cache_hits=0.0,
                scraped_at=42.0,
            ),
            id="vllm",
        ),
        pytest.param(
            "sglang",
            "sglang",
            EndpointMetrics(
                waiting=3.0,
                running=12.0,
                kv_usage=0.28672,
                block_size=1,  # sglang:page_size gauge
                num_blocks=200000,  # sglang:num_pages gauge
                prefix_cache_queries=184320.0,  # sglang:prompt_tokens_total
                prefix_cache_hits=122880.0,  # sglang:cached_tokens_total
                scraped_at=42.0,
            ),
            id="sglang",
        ),
        pytest.param(
            "trtllm",
            "trtllm-serve",
            EndpointMetrics(
                waiting=2.0,
                running=4.0,
                kv_usage=0.055374130342183726,
                block_size=32,
                num_blocks=21129,
                scraped_at=42.0,
            ),
            id="trtllm",
        ),
        pytest.param(
            "triton",
            "triton-tensorrt-llm",
            EndpointMetrics(
                waiting=1.0,  # request_type="waiting"
                running=1.0,  # request_type="scheduled"
                kv_usage=0.4875,  # kv_cache_block_type="fraction"
                block_size=64,  # "tokens_per"
                num_blocks=6239,  # "max"
                scraped_at=42.0,
            ),
            id="triton",
        ),
    ],
)
def test_fixture_values(fixture: str, engine: str, expected: EndpointMetrics) -> None:
    assert parse(engine, page(fixture)) == expected


def test_fixture_missing_signals_are_reported() -> None:
    result = MetricsParser(ENGINES["trtllm-serve"]).parse(page("trtllm"), now=1.0)
    assert result.missing == ()
    result = MetricsParser(ENGINES["vllm"]).parse(page("sglang"), now=1.0)
    assert result.missing == (
        "waiting",
        "running",
        "kv_usage",
        "block_size",
        "num_blocks",
        "lora",
        "prefix_cache_queries",
        "prefix_cache_hits",
    )
    assert result.metrics == EndpointMetrics(scraped_at=1.0)


VLLM_DATA_PARALLEL = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0
"""


def test_vllm_data_parallel_engines() -> None:
    metrics = parse("vllm", VLLM_DATA_PARALLEL)
    assert metrics.running == 8.0  # 3 + 5
    assert metrics.waiting == 1.0  # 1 + 0
    assert metrics.kv_usage == pytest.approx(0.4)  # (0.2 + 0.6) / 2
    assert metrics.block_size == 16  # max over engines
    assert metrics.num_blocks == 2000  # 1000 + 1000: each engine has its own cache
    assert metrics.prefix_cache_hits == 40.0  # 10 + 30


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        pytest.param(
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
            'waiting_lora_adapters="c"} 1700000002.0\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
            'waiting_lora_adapters=""} 1700000001.0\n',
            LoraInfo(4, frozenset({"a", "b"}), frozenset({"c"})),
            id="largest-value-is-current",
        ),
        pytest.param(
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="x, y,",'
            'waiting_lora_adapters=""} 1.0\n',
            LoraInfo(2, frozenset({"x", "y"}), frozenset()),
            id="spaces-and-trailing-comma",
        ),
        pytest.param(
            'vllm:lora_requests_info{running_lora_adapters="a",waiting_lora_adapters=""} 1.0\n',
            None,
            id="no-max-lora",
        ),
        pytest.param(
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
            'waiting_lora_adapters=""} NaN\n',
            None,
            id="nan-value",
        ),
    ],
)
def test_lora_info(lines: str, expected: LoraInfo | None) -> None:
    assert parse("vllm", lines).lora == expected


@pytest.mark.parametrize(
    ("line", "block_size", "num_blocks"),
    [
        pytest.param(
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1.0',
            32,
            None,
            id="literal-None",
        ),
        pytest.param('vllm:cache_config_info{block_size="None"} 1.0', None, None, id="all-None"),
        pytest.param(
            'vllm:cache_config_info{block_size="0",num_gpu_blocks="x"} 1.0',
            None,
            None,
            id="zero-and-text",
        ),
        pytest.param(
            'vllm:cache_config_info{block_size="16",mamba_block_size="512",'
            'user_specified_block_size="True",num_gpu_blocks="74272"} 1.0',
            16,
            74272,
            id="similar-label-names",
        ),
    ],
)
def test_cache_config_info_labels(
    line: str, block_size: int | None, num_blocks: int | None
) -> None:
    metrics = parse("vllm", line + "\n")
    assert (metrics.block_size, metrics.num_blocks) == (block_size, num_blocks)


def test_old_vllm_names() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 60.0\n'
    )
    metrics = parse("vllm", text)
    assert (metrics.kv_usage, metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (
        0.25,
        100.0,
        60.0,
    )


def test_new_name_wins_over_old_name() -> None:
    text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.3\n"
    assert parse("vllm", text).kv_usage == 0.3


def test_sglang_underscore_spelling_and_cache_config_labels() -> None:
    text = (
        'sglang_num_queue_reqs{tp_rank="0"} 2\n'
        'sglang_num_running_reqs{tp_rank="0"} 7\n'
        'sglang_token_usage{tp_rank="0"} 0.5\n'
        'sglang:cache_config_info{num_pages="4096",page_size="16"} 1\n'
        "sglang:page_size 1\n"
    )
    metrics = parse("sglang", text)
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (2.0, 7.0, 0.5)
    # cache_config_info labels are preferred to the page_size gauge
    assert (metrics.block_size, metrics.num_blocks) == (16, 4096)


@pytest.mark.parametrize(
    ("kv_lines", "kv_usage", "missing"),
    [
        pytest.param(
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="m"} 1500\n'
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="m"} 6000\n',
            0.25,  # 1500 / 6000
            (),
            id="used-over-max",
        ),
        pytest.param(
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="m"} 10\n'
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="m"} 0\n',
            0.0,
            ("kv_usage",),
            id="max-zero",
        ),
        pytest.param(
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="m"} 0.7\n'
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="m"} 1\n'
            'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="m"} 10\n',
            0.7,
            (),
            id="fraction-first",
        ),
    ],
)
def test_triton_kv_usage(kv_lines: str, kv_usage: float, missing: tuple[str, ...]) -> None:
    requests = (
        'nv_trt_llm_request_metrics{model="m",request_type="waiting",version="1"} 2\n'
        'nv_trt_llm_request_metrics{model="m",request_type="scheduled",version="1"} 3\n'
        'nv_trt_llm_request_metrics{model="m",request_type="active",version="1"} 9\n'
    )
    result = MetricsParser(ENGINES["triton-tensorrt-llm"]).parse(requests + kv_lines, now=0.0)
    assert (result.metrics.waiting, result.metrics.running) == (2.0, 3.0)
    assert result.metrics.kv_usage == kv_usage
    assert set(missing) <= set(result.missing)


def test_label_values_with_escapes_commas_and_braces() -> None:
    text = (
        '# HELP vllm:num_requests_waiting Number of "requests" \\\\ waiting.\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="a \\"b\\", c",engine="0"} 2.0\n'
        'vllm:num_requests_waiting{model_name="x}y {z=1}",engine="1"} 3.0\n'
        'vllm:num_requests_waiting{model_name="line\\nbreak\\\\",engine="2"} 4.0\n'
    )
    parser = MetricsParser(ENGINES["vllm"])
    found, malformed = parser.scan(text)
    assert malformed == 0
    assert found == reference_series(text, parser.families)
    assert [labels["model_name"] for labels, _ in found["vllm:num_requests_waiting"]] == [
        'a "b", c',
        "x}y {z=1}",
        "line\nbreak\\",
    ]
    assert parse("vllm", text).waiting == 9.0  # 2 + 3 + 4


@pytest.mark.parametrize(
    ("text", "waiting"),
    [
        pytest.param("vllm:num_requests_waiting 5\n", 5.0, id="first-line-no-labels"),
        pytest.param("vllm:num_requests_waiting{} 5", 5.0, id="empty-labels-no-newline"),
        pytest.param('vllm:num_requests_waiting{a="b",} 5\n', 5.0, id="trailing-comma"),
        pytest.param('vllm:num_requests_waiting{a="b"} 5 1700000000000\n', 5.0, id="timestamp"),
        pytest.param('vllm:num_requests_waiting{a="b"} 5\r\n', 5.0, id="crlf"),
        pytest.param("x 1\r\nvllm:num_requests_waiting\t6\r\n", 6.0, id="tab-separator"),
        pytest.param('vllm:num_requests_waiting{a = "b" , c="d"} 7\n', 7.0, id="spaces-in-labels"),
        pytest.param("vllm:num_requests_waiting 1e+01\n", 10.0, id="exponent"),
        pytest.param("vllm:num_requests_waiting NaN\n", 0.0, id="nan-ignored"),
        pytest.param("vllm:num_requests_waiting +Inf\n", 0.0, id="inf-ignored"),
        pytest.param(
            'vllm:num_requests_waiting 2\nvllm:num_requests_waiting{engine="1"} NaN\n',
            2.0,
            id="nan-series-skipped",
        ),
        pytest.param(
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 9\n'
            "vllm:num_requests_waiting_total 9\n",
            0.0,
            id="longer-names-not-matched",
        ),
        pytest.param("# vllm:num_requests_waiting 9\n", 0.0, id="comment"),
    ],
)
def test_line_forms(text: str, waiting: float) -> None:
    assert parse("vllm", text).waiting == waiting


def test_created_series_are_not_read_as_the_counter() -> None:
    text = (
        'vllm:prefix_cache_queries_total{engine="0"} 12.0\n'
        'vllm:prefix_cache_queries_created{engine="0"} 1.795949550859318e+09\n'
    )
    assert parse("vllm", text).prefix_cache_queries == 12.0


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("vllm:num_requests_waiting", id="no-value"),
        pytest.param("vllm:num_requests_waiting ", id="blank-value"),
        pytest.param("vllm:num_requests_waiting abc", id="text-value"),
        pytest.param("vllm:num_requests_waiting 1 2 3", id="three-fields"),
        pytest.param("vllm:num_requests_waiting 1 soon", id="bad-timestamp"),
        pytest.param('vllm:num_requests_waiting{a="b" 1', id="unclosed-labels"),
        pytest.param('vllm:num_requests_waiting{a="b} 1', id="unclosed-quote"),
        pytest.param("vllm:num_requests_waiting{a=b} 1", id="unquoted-value"),
        pytest.param('vllm:num_requests_waiting{a="b"c="d"} 1', id="missing-comma"),
        pytest.param('vllm:num_requests_waiting{1a="b"} 1', id="bad-label-name"),
        pytest.param('vllm:num_requests_waiting{a="b"}} 1', id="extra-brace"),
    ],
)
def test_malformed_lines_are_skipped_and_counted(line: str) -> None:
    text = f"vllm:num_requests_running 4\n{line}\nvllm:num_requests_waiting 2\n"
    result = MetricsParser(ENGINES["vllm"]).parse(text, now=0.0)
    assert result.malformed == 1
    assert result.samples == 2
    assert (result.metrics.running, result.metrics.waiting) == (4.0, 2.0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param("", {}, id="empty"),
        pytest.param('a="1",b="2"', {"a": "1", "b": "2"}, id="plain"),
        pytest.param('a="x,y=\\"z\\""', {"a": 'x,y="z"'}, id="escaped"),
        pytest.param('a="1",,b="2"', None, id="double-comma"),
        pytest.param('a="1" junk', None, id="junk"),
    ],
)
def test_parse_labels(body: str, expected: dict[str, str] | None) -> None:
    assert parse_labels(body) == expected


def test_label_cache_is_bounded() -> None:
    parser = MetricsParser(ENGINES["vllm"])
    text = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(1000))
    result = parser.parse(text, now=0.0)
    assert result.metrics.waiting == 1000.0
    assert len(parser._label_cache) <= 256


def test_huge_and_binary_input() -> None:
    huge = 'vllm:num_requests_waiting{model_name="' + "x" * 2_000_000 + '"} 3\n'
    assert parse("vllm", huge).waiting == 3.0
    binary = bytes(range(256)) * 512
    result = MetricsParser(ENGINES["vllm"]).parse(binary.decode("latin-1"), now=0.0)
    assert result.metrics.waiting == 0.0


@pytest.mark.parametrize(
    ("line", "malformed"),
    [
        pytest.param("vllm:num_requests_waiting" + " " * 50_000 + "x y z", 1, id="spaces"),
        pytest.param("vllm:num_requests_waiting{" + "} a" * 50_000, 1, id="braces"),
        pytest.param(
            'vllm:num_requests_waiting{a="' + '\\"' * 50_000 + "} 1", 1, id="escaped-quotes"
        ),
        pytest.param(
            "vllm:num_requests_waiting{" + 'a="b",' * 20_000 + "junk} 1", 1, id="bad-tail"
        ),
        pytest.param("vllm:num_requests_waiting{" + ' a = "b" ,' * 20_000 + "} 1", 0, id="spaced"),
    ],
)
def test_hostile_lines_are_handled_in_one_pass(line: str, malformed: int) -> None:
    # guards against backtracking patterns: the "spaces" line once took minutes
    result = MetricsParser(ENGINES["vllm"]).parse(line + "\n", now=0.0)
    assert result.malformed == malformed


FRAGMENTS = [
    "vllm:num_requests_waiting",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
    "nv_trt_llm_kv_cache_block_metrics",
    "{",
    "}",
    '"',
    "\\",
    "=",
    ",",
    " ",
    "\n",
    "\r\n",
    "\t",
    "NaN",
    "+Inf",
    "-1e309",
    "1e400",
    "0",
    "3.5",
    "max_lora",
    'block_size="',
    'kv_cache_block_type="used"',
    'kv_cache_block_type="max"',
    "None",
    "# HELP ",
    "# TYPE ",
]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    for engine in ENGINES.values():
        result = MetricsParser(engine).parse(text, now=1.0)
        assert result.malformed >= 0


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=40))
def test_metric_like_text_never_raises(parts: list[str]) -> None:
    text = "".join(parts)
    for engine in ENGINES.values():
        metrics = MetricsParser(engine).parse(text, now=1.0).metrics
        assert math.isfinite(metrics.waiting)
        assert math.isfinite(metrics.kv_usage)
        assert metrics.block_size is None or metrics.block_size >= 1


# -- real vLLM 0.32 pages (tests/fixtures/real/) -----------------------------------


def recorded_signals(page: str) -> dict[str, object]:
    """vllm_metrics.json: the page's signals as the recorder read them with prometheus_client."""
    doc = dict(json.loads((REAL / "vllm_metrics.json").read_text())[page])
    lora = doc["lora"]
    if lora is not None:
        doc["lora"] = LoraInfo(
            lora["max_lora"], frozenset(lora["running"]), frozenset(lora["waiting"])
        )
    return doc


@pytest.mark.parametrize("page", REAL_PAGES.values(), ids=list(REAL_PAGES))
def test_real_vllm_page_gives_the_recorded_signals(page: str) -> None:
    result = MetricsParser(ENGINES["vllm"]).parse((REAL / page).read_text(), now=42.0)
    assert as_dict(result.metrics) == recorded_signals(page)
    assert (result.missing, result.malformed) == ((), 0)


@pytest.mark.parametrize("page", REAL_PAGES.values(), ids=list(REAL_PAGES))
def test_real_vllm_page_equals_prometheus_client(page: str) -> None:
    text = (REAL / page).read_text()
    parser = MetricsParser(ENGINES["vllm"])
    found, malformed = parser.scan(text)
    assert malformed == 0
    assert found == reference_series(text, parser.families)
    expected = reference_metrics(ENGINES["vllm"], text)
    for signal in ("block_size", "num_blocks"):
        value = expected[signal]
        expected[signal] = int(value) if isinstance(value, float) else None
    assert as_dict(parser.parse(text, now=1.0).metrics) == expected


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        pytest.param(
            "vllm_metrics.txt",
            EndpointMetrics(
                waiting=1.0,
                running=2.0,
                # vLLM: 1 - free / usable = 1 - 77 / (128 - 1 null block): 50 blocks held
                kv_usage=1 - 77 / 127,
                block_size=32,
                num_blocks=128,
                # the latest series by value; both labels list every adapter in flight
                lora=LoraInfo(2, frozenset({"a1", "a2"}), frozenset({"a1", "a2"})),
                prefix_cache_queries=5826.0,
                prefix_cache_hits=96.0,  # 3 blocks of a repeated 108-token prompt
                scraped_at=42.0,
            ),
            id="held-a1-a2-running-a3-waiting",
        ),
        pytest.param(
            "vllm_metrics_idle.txt",
            EndpointMetrics(
                block_size=32,
                num_blocks=128,
                # five series; the one with the largest timestamp has empty labels
                lora=LoraInfo(2),
                prefix_cache_queries=5832.0,
                prefix_cache_hits=96.0,
                scraped_at=42.0,
            ),
            id="idle",
        ),
    ],
)
def test_real_vllm_page_values(page: str, expected: EndpointMetrics) -> None:
    assert parse("vllm", (REAL / page).read_text()) == expected
