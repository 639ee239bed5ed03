"""The engine tier: real vLLM servers on CPU, started once per session.

Run with `make test-engine` (it builds `.venv-engine`). Nothing here skips: a test
that would skip is reported as a failure, because a tier that silently skips proves
nothing. When a test fails, the tails of the vLLM and gateway logs are attached
to its report.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import LOG_SOURCES, GatewayProcess, running_gateway

from servegate.testing.tinymodel import TinyModel, build_tiny_model
from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster

REPLICAS = int(os.environ.get("SERVEGATE_ENGINE_REPLICAS", "2"))
MODEL = "tiny"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"the engine tier never skips; this test tried to: {report.longrepr}"
    if report.failed:
        for title, logs in LOG_SOURCES.items():
            report.sections.append((title, logs()))


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    return build_tiny_model()


@pytest.fixture(scope="session")
def cluster(
    tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmCluster]:
    workdir = tmp_path_factory.mktemp("vllm")
    vllm = VllmCluster(tiny_model, ClusterSettings(replicas=REPLICAS), workdir)
    LOG_SOURCES["vLLM server logs"] = vllm.logs
    try:
        vllm.start()
        print(f"\n{REPLICAS} vLLM servers healthy after {vllm.startup_s:.1f} s: {vllm.urls}")
        yield vllm
    finally:
        vllm.stop()
        LOG_SOURCES.pop("vLLM server logs", None)


@pytest.fixture(scope="session")
def gateway(
    cluster: VllmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    with running_gateway(cluster.servers, tmp_path_factory.mktemp("gateway"), model=MODEL) as proc:
        yield proc
