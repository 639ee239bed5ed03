"""bench/gateway_overhead.py, run with a second fast backend standing in for the gateway."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import orjson
import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "gateway_overhead.py"
STAND_IN = "{python} -m servegate.testing.fastbackend --port {port}"


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gateway_overhead", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gateway_overhead"] = module
    spec.loader.exec_module(module)
    return module


BURN = (
    "import time\n"
    "while time.process_time() < 0.05: pass\n"  # exactly >= 50 ms of CPU, then idle
    "print('done', flush=True)\n"
    "time.sleep(30)\n"
)


def test_process_tree_cpu_counts_live_children(overhead: ModuleType) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", BURN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"done\n"
        alone = overhead.process_tree_cpu_s(child.pid)
        with_parent = overhead.process_tree_cpu_s(os.getpid())
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert alone >= 0.04  # 50 ms burnt; clock ticks are 10 ms
    assert with_parent >= alone


def test_direct_versus_stand_in_gateway(
    overhead: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    out = tmp_path / "rows.json"
    code = overhead.main(
        [
            "--gateway-cmd",
            STAND_IN,
            "--requests",
            "20",
            "--rounds",
            "2",
            "--concurrency",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = orjson.loads(out.read_bytes())
    # stream no/yes x direct/gateway
    assert [(r["stream"], r["path"]) for r in rows] == [
        (False, "direct"),
        (False, "gateway"),
        (True, "direct"),
        (True, "gateway"),
    ]
    for row in rows:
        assert (row["requests"], row["errors"]) == (20, 0)  # 2 rounds x 10
        assert row["p50_ms"] > 0
    for row in rows[1::2]:
        assert row["added_p50_ms"] is not None
        assert row["gateway_cpu_us"] is not None
    captured = capsys.readouterr()
    assert "| no | 2 | gateway | 20 | 0 |" in captured.out
    assert time.monotonic() - started < 60


def test_gateway_that_does_not_start_is_skipped_with_its_reason(
    overhead: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = overhead.main(
        [
            "--gateway-cmd",
            "{python} -c 'raise SystemExit(3)'",
            "--requests",
            "4",
            "--rounds",
            "1",
            "--concurrency",
            "1",
            "--stream",
            "no",
            "--startup-timeout",
            "10",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "gateway skipped" in captured.err
    assert "exited with code 3" in captured.err
    assert "| no | 1 | direct | 4 | 0 |" in captured.out
    assert "| gateway |" not in captured.out


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux's taskset")
def test_pin_runs_each_gateway_under_taskset(
    overhead: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--gateway-cmd", STAND_IN, "--compare", f"other={STAND_IN}", "--pin", "0"]
    code = overhead.main(
        [*args, "--requests", "4", "--rounds", "1", "--concurrency", "1", "--stream", "no"]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "gateway: taskset -c 0 " in captured.err
    assert "other: taskset -c 0 " in captured.err
    assert "| no | 1 | other | 4 | 0 |" in captured.out


def test_fronts_are_known_names(overhead: ModuleType) -> None:
    assert overhead.parse_fronts("granian-rsgi, uvicorn") == ["granian-rsgi", "uvicorn"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown front nginx"):
        overhead.parse_fronts("uvicorn,nginx")
