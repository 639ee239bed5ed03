"""bench/peer_routers.py's command lines and latency_slo.py's glue for the peer policies."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_modules() -> Iterator[tuple[ModuleType, ModuleType]]:
    """The two scripts, imported as `bench/` runs them (its folder on the path)."""
    added = str(BENCH) not in sys.path
    if added:
        sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("peer_routers"), importlib.import_module("latency_slo")
    finally:
        if added:
            sys.path.remove(str(BENCH))


@pytest.fixture
def peers(bench_modules: tuple[ModuleType, ModuleType]) -> ModuleType:
    return bench_modules[0]


@pytest.fixture
def slo(bench_modules: tuple[ModuleType, ModuleType]) -> ModuleType:
    return bench_modules[1]


@pytest.fixture
def peer_dir(tmp_path: Path) -> Path:
    for name in ("vllm-router", "sglang-router"):
        (tmp_path / name).write_text("#!/bin/sh\n")
    return tmp_path


URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize(
    ("kind", "head"),
    [
        pytest.param("vllm-router", ["vllm-router"], id="vllm-router"),
        pytest.param("sglang-router", ["sglang-router", "launch"], id="sglang-router"),
    ],
)
def test_peer_command_uses_cache_aware_own_ports_and_every_worker(
    peers: ModuleType, kind: str, head: list[str]
) -> None:
    cmd = peers.peer_command(kind, Path("/opt/peers"), 9000, 9100, URLS)
    assert cmd[0] == f"/opt/peers/{head[0]}"
    assert cmd[1 : len(head)] == head[1:]
    flags = dict(zip(cmd[len(head) :: 2], cmd[len(head) + 1 :: 2], strict=False))
    assert flags["--policy"] == "cache_aware"
    assert flags["--port"] == "9000"
    assert flags["--prometheus-port"] == "9100"
    assert cmd[cmd.index("--worker-urls") + 1 :] == URLS


def test_peer_command_refuses_an_unknown_peer(peers: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown peer router 'nginx'"):
        peers.peer_command("nginx", Path("/opt/peers"), 9000, 9100, URLS)


def test_missing_peers_names_only_the_requested_absent_executables(
    peers: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "vllm-router").write_text("")
    kinds = ["default", "slo", "vllm-router", "sglang-router"]
    assert peers.missing_peers(kinds, tmp_path) == [str(tmp_path / "sglang-router")]
    assert peers.missing_peers(["default", "slo"], tmp_path / "nowhere") == []


def test_latency_slo_accepts_the_peers_from_a_folder_that_has_them(
    slo: ModuleType, peer_dir: Path
) -> None:
    policies = ["--policy", "slo", "--policy", "vllm-router", "--policy", "sglang-router"]
    args = slo.parse_args([*policies, "--peers", str(peer_dir)])
    assert args.policy == ["slo", "vllm-router", "sglang-router"]
    assert args.peers == peer_dir


def test_latency_slo_refuses_a_peer_it_cannot_find(
    slo: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        slo.parse_args(["--policy", "sglang-router", "--peers", str(tmp_path)])
    assert f"no peer router at {tmp_path / 'sglang-router'}" in capsys.readouterr().err


def test_latency_slo_looks_for_the_peers_in_the_repository_by_default(slo: ModuleType) -> None:
    args = slo.parse_args(["--policy", "default"])
    assert args.peers == BENCH.parent.resolve() / ".venv-peers" / "bin"


def test_a_peer_row_reports_no_predictor_error(slo: ModuleType) -> None:
    from servegate.bench.client import RequestResult
    from servegate.bench.workloads import BenchRequest

    item = slo.Item(BenchRequest(model="m", max_tokens=4, prompt="p"), "chat", 1.0, 0.2, 0.0)
    ok = RequestResult(started_at=0.0, status=200, e2e_s=0.5, ttft_s=0.3, itl_s=(0.1,))
    peer_row, gateway_row = (slo.Row(p, [item], [ok], 1.0, []) for p in ("vllm-router", "slo"))
    peer_line, gateway_line = slo.table([peer_row, gateway_row]).splitlines()[-2:]
    assert peer_line.startswith("| vllm-router | 100.0% /")
    assert peer_line.endswith("| n/a (no predictor) |")
    assert gateway_line.endswith("| — (—) / — (0) |")
