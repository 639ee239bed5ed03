"""`servegate bench` end to end, driving the fast backend (its own process) by URL."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import typer
from typer.testing import CliRunner

from servegate.bench.cli import bench_command
from servegate.bench.trace import read_trace

app = typer.Typer()
app.command("bench")(bench_command)


@app.command("other")
def other() -> None:
    """A second command, so `bench` is addressed by name as in `servegate bench`."""


@pytest.fixture(scope="module")
def backend_url() -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "servegate.testing.fastbackend", "--port", "0", "--chunks", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.removeprefix("listening on ")
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def bench(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["bench", *args])
    return result.exit_code, result.output


SMALL = ["--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "16"]


def test_compares_two_targets_and_writes_everything(backend_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    code, output = bench(
        "--target",
        f"a={backend_url}",
        "--target",
        f"b={backend_url}",
        "--engine",
        backend_url,
        *SMALL,
        "--concurrency",
        "2",
        "--rounds",
        "2",
        "--no-progress",
        "--save-trace",
        str(tmp_path / "trace.jsonl"),
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 0, output
    assert "| a | c=2 | 6 | 0 |" in output
    assert "| b | c=2 | 6 | 0 |" in output
    # ratios against the first target, with intervals over the 2 rounds, and a warning
    # that 3 requests per round are too few for a p99
    assert "[c=2] b vs a: TTFT p50 " in output
    assert "(2 rounds; 95 % intervals)" in output
    assert "warning: b vs a at c=2: a round has only 3 successful requests" in output
    for name in ("report.md", "summary.json", "summary.csv", "requests.csv", "ttft_cdf.png"):
        assert (tmp_path / "out" / name).is_file()
    document = orjson.loads((tmp_path / "out" / "summary.json").read_bytes())
    assert "model=fast" in document["meta"]["workload"]  # discovered from /v1/models
    first = document["summaries"][0]
    # the one engine served all of a's 6 requests: balance max/mean = 1
    assert first["replica_requests"] == {backend_url: 6.0}
    assert first["balance_source"] == "engine"
    assert len(read_trace(tmp_path / "trace.jsonl")) == 6  # 2 groups x 3 prompts
    assert time.monotonic() - started < 60


def test_replays_a_trace_and_runs_other_workloads(backend_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    code, output = bench(
        "-t",
        f"direct={backend_url}",
        "--workload",
        "multi-turn",
        "--sessions",
        "2",
        "--turns",
        "2",
        "--rate",
        "50",
        "--rate",
        "100",
        "--no-progress",
        "--save-trace",
        str(trace),
        "--out",
        str(tmp_path / "mt"),
    )
    assert code == 0, output
    assert (tmp_path / "mt" / "sweep.png").is_file()
    stamps = [r.timestamp for r in read_trace(trace)]
    assert stamps[0] == 0.0
    assert stamps[-1] > 0.0  # Poisson timestamps at the lowest rate
    code, output = bench(
        "-t",
        f"direct={backend_url}",
        "--trace",
        str(trace),
        "--trace-speed",
        "10",
        "--no-stream",
        "--no-progress",
        "--out",
        str(tmp_path / "replay"),
    )
    assert code == 0, output
    assert "| direct | trace@10x | 4 | 0 |" in output
    code, output = bench(
        "-t",
        f"direct={backend_url}",
        "--workload",
        "lora-mix",
        "--adapter",
        "a1",
        "--adapter",
        "a2",
        "--num-requests",
        "5",
        "--prompt-len",
        "8",
        "--api",
        "chat",
        "--no-progress",
        "--out",
        str(tmp_path / "lora"),
    )
    assert code == 0, output
    assert "| direct | c=8 | 5 | 0 |" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--workload", "lora-mix"], "needs --adapter", id="lora-without-adapter"),
        pytest.param(["--workload", "nope"], "unknown --workload", id="unknown-workload"),
        pytest.param(["--rate", "1", "--concurrency", "2"], "one load shape", id="two-shapes"),
        pytest.param(["--reset-cache"], "--engine", id="reset-without-engine"),
        pytest.param(["--api", "grpc"], "grpc", id="bad-api"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    backend_url: str, tmp_path: Path, args: list[str], message: str
) -> None:
    code, output = bench("-t", f"a={backend_url}", *args, "--out", str(tmp_path))
    assert code == 2
    assert message in output


def test_bad_target_and_bad_trace(tmp_path: Path) -> None:
    code, output = bench("-t", "nourl", "--out", str(tmp_path))
    assert code == 2
    assert "name=http" in output
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"oops": 1}\n')
    code, output = bench(
        "-t", "a=http://127.0.0.1:9", "--trace", str(trace), "--out", str(tmp_path)
    )
    assert code == 2
    assert "bad.jsonl:1" in output


def test_without_matplotlib_the_bench_stops_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No plots possible: exit 2 at once with the install hint, not after a long run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, output = bench("--target", "a=http://127.0.0.1:1", "--out", str(tmp_path / "out"))
    assert code == 2
    assert "pip install 'servegate[bench]'" in output
    assert not (tmp_path / "out").exists()
