from __future__ import annotations

import csv
import struct
import sys
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from servegate.bench.client import RequestResult
from servegate.bench.report import (
    SUMMARY_COLUMNS,
    PlotsUnavailable,
    markdown_table,
    plot_sweep,
    rich_progress,
    time_axis_scale,
    verdict,
    verdicts,
    write_report,
)
from servegate.bench.runner import LoadKind, LoadPoint, Target, TargetRun
from servegate.bench.stats import TargetSummary, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def summary(target: str, load: str = "c=4", **fields: object) -> TargetSummary:
    base: dict[str, object] = {
        "target": target,
        "url": "http://127.0.0.1:1",
        "load": load,
        "load_kind": "concurrency",
        "load_value": 4.0,
        "requests": 10,
        "errors": 0,
    }
    return TargetSummary(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("other", "base", "expected"),
    [
        pytest.param(
            summary("approx", ttft_p50_s=0.042, output_tok_per_s=190.0),
            summary("base", ttft_p50_s=0.1, output_tok_per_s=100.0),
            # 0.042 / 0.1 = 0.42; 190 / 100 = 1.9
            "approx: TTFT p50 0.42x base, throughput 1.90x",
            id="ttft-and-throughput",
        ),
        pytest.param(
            summary("x", e2e_p50_s=0.3, req_per_s=4.0, hit_rate=0.71),
            summary("base", e2e_p50_s=0.2, req_per_s=8.0, hit_rate=0.23),
            # no TTFT (not streamed): e2e 0.3 / 0.2 = 1.5; no tokens: req/s 4 / 8 = 0.5
            "x: e2e p50 1.50x base, throughput 0.50x, hit rate 71.0 % vs 23.0 %",
            id="e2e-fallback-and-hit-rate",
        ),
        pytest.param(
            summary("x", errors=3),
            summary("base"),
            "x: errors 3 vs 0",
            id="errors-only",
        ),
    ],
)
def test_verdict(other: TargetSummary, base: TargetSummary, expected: str) -> None:
    assert verdict(other, base) == expected


def test_verdict_of_the_first_target_is_baseline() -> None:
    first = summary("rr")
    assert verdict(first, first) == "rr: baseline"


def test_verdicts_compare_within_each_load_point() -> None:
    lines = verdicts(
        [
            summary("a", load="c=1", req_per_s=10.0),
            summary("b", load="c=1", req_per_s=20.0),
            summary("a", load="c=8", req_per_s=40.0),
            summary("b", load="c=8", req_per_s=20.0),
        ]
    )
    assert lines == [
        "[c=1] a: baseline",
        "[c=1] b: throughput 2.00x",  # 20 / 10
        "[c=8] a: baseline",
        "[c=8] b: throughput 0.50x",  # 20 / 40
    ]


def test_markdown_table_has_one_row_per_summary() -> None:
    table = markdown_table(
        [
            summary("a", ttft_p50_s=0.0123, hit_rate=0.5, hit_rate_source="engine", balance=1.25),
            summary("b", hit_rate=0.1, hit_rate_source="usage"),
        ]
    )
    header, rule, first, second = table.splitlines()
    assert header.count("|") == len(SUMMARY_COLUMNS) + 1
    assert rule.count("---") == len(SUMMARY_COLUMNS)
    assert first.startswith("| a | c=4 | 10 | 0 |")
    assert "12.3 ms" in first
    assert "50.0 %" in first
    assert "1.25" in first
    assert "10.0 % (usage)" in second


def result(e2e: float, ttft: float | None) -> RequestResult:
    return RequestResult(started_at=e2e, status=200, e2e_s=e2e, ttft_s=ttft, output_tokens=4)


def runs_for(points: list[LoadPoint], stream: bool = True) -> list[TargetRun]:
    runs = []
    for point in points:
        for name, scale in (("base", 1.0), ("fast", 0.5)):
            run = TargetRun(Target(name, "http://127.0.0.1:1"), point)
            run.results = [
                result(0.1 * i * scale, 0.01 * i * scale if stream else None) for i in range(1, 21)
            ]
            run.results.append(
                RequestResult(started_at=0.0, status=503, e2e_s=0.1, error_kind="503", error="x")
            )
            run.wall_s = 2.0
            runs.append(run)
    return runs


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@pytest.mark.parametrize(
    ("points", "stream", "expected_plots"),
    [
        pytest.param([LoadPoint(LoadKind.CONCURRENCY, 4)], True, ["ttft_cdf.png"], id="one-point"),
        pytest.param(
            [LoadPoint(LoadKind.RATE, 1), LoadPoint(LoadKind.RATE, 2)],
            True,
            ["ttft_cdf.png", "sweep.png"],
            id="rate-sweep",
        ),
        pytest.param(
            [LoadPoint(LoadKind.CONCURRENCY, 1), LoadPoint(LoadKind.CONCURRENCY, 8)],
            False,
            ["ttft_cdf.png", "sweep.png"],
            id="sweep-not-streamed",
        ),
    ],
)
def test_write_report(
    tmp_path: Path, points: list[LoadPoint], stream: bool, expected_plots: list[str]
) -> None:
    runs = runs_for(points, stream)
    summaries = [summarize(run) for run in runs]
    meta = {"command": "servegate bench -t base=...", "workload": "test"}
    written = write_report(tmp_path / "out", runs, summaries, meta)
    names = sorted(p.name for p in written)
    assert names == sorted(
        [*expected_plots, "summary.json", "summary.csv", "requests.csv", "report.md"]
    )
    for plot in expected_plots:
        width, height = png_size(tmp_path / "out" / plot)
        assert width > 100
        assert height > 100

    document = orjson.loads((tmp_path / "out" / "summary.json").read_bytes())
    assert document["meta"] == meta
    assert [s["target"] for s in document["summaries"]] == [s.target for s in summaries]
    assert document["summaries"][0]["errors_by_kind"] == {"503": 1}

    with (tmp_path / "out" / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(summaries)
    assert rows[0]["target"] == "base"
    assert float(rows[0]["req_per_s"]) == pytest.approx(10.0)  # 20 ok / 2 s

    with (tmp_path / "out" / "requests.csv").open() as handle:
        request_rows = list(csv.DictReader(handle))
    assert len(request_rows) == 21 * len(runs)
    assert {r["error_kind"] for r in request_rows} == {"", "503"}

    report = (tmp_path / "out" / "report.md").read_text()
    assert "servegate bench -t base=..." in report
    for point in points:
        assert f"## {point.label}" in report
    assert "fast: " in report
    for plot in expected_plots:
        assert f"]({plot})" in report


def test_no_successful_request_writes_no_plot(tmp_path: Path) -> None:
    run = TargetRun(Target("a", "http://127.0.0.1:1"), LoadPoint(LoadKind.CONCURRENCY, 1))
    run.results = [RequestResult(0.0, 0, 0.1, error_kind="connection", error="refused")]
    written = write_report(tmp_path, [run], [summarize(run)], {})
    assert not [p for p in written if p.suffix == ".png"]
    assert "errors of a: connection: 1" in (tmp_path / "report.md").read_text()


def test_rich_progress_counts_and_flags_errors() -> None:
    console = Console(record=True, width=120, force_terminal=False)
    with rich_progress(console) as sink:
        sink.start("a c=1 round 1/1", 2)
        sink.advance(result(0.1, 0.01))
        sink.advance(RequestResult(0.0, 0, 0.1, error_kind="timeout", error="x"))
    text = console.export_text()
    assert "a c=1 round 1/1" in text
    assert "1 errors" in text
    assert "2/2" in text


def test_report_mentions_failed_engine_reads(tmp_path: Path) -> None:
    failing = summary("a", engine_scrapes_failed=3)
    write_report(tmp_path, [], [failing], {})
    assert "3 engine /metrics reads failed" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    ("fastest", "slowest", "scale"),
    [
        pytest.param(10.0, 150.0, "linear", id="15x-spread"),
        pytest.param(10.0, 200.0, "linear", id="20x-spread-is-the-limit"),
        pytest.param(10.0, 800.0, "log", id="80x-spread"),
        pytest.param(0.0, 800.0, "linear", id="zero-has-no-log"),
    ],
)
def test_time_axis_turns_logarithmic_for_a_wide_spread(
    fastest: float, slowest: float, scale: str
) -> None:
    assert time_axis_scale(fastest, slowest) == scale


def test_without_matplotlib_a_plot_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is the optional `bench` extra: missing, the message says how to get it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    runs = runs_for([LoadPoint(LoadKind.CONCURRENCY, 1), LoadPoint(LoadKind.CONCURRENCY, 2)], True)
    with pytest.raises(PlotsUnavailable, match=r"pip install 'servegate\[bench\]'"):
        plot_sweep(tmp_path / "sweep.png", [summarize(run) for run in runs], runs)
    assert not (tmp_path / "sweep.png").exists()
