"""A real Prometheus (Debian's package) scrapes a running gateway, simulators and a
DCGM-shaped exporter on loopback; every PromQL expression of the Grafana dashboard
and of the Prometheus Adapter rules (rendered with the HPAs' selectors, as the
adapter does) must return data through Prometheus's HTTP API.

Bounded: 1 s scrapes, and the whole run gives up after EVALUATION_DEADLINE_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.deploy.fake_dcgm import FakeDcgmExporter, Gpu
from tests.deploy.render import build
from tests.integration.conftest import FAST_SIM, MODEL

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
POOL = "llm-pool"
EVALUATION_DEADLINE_S = 25.0
PREFIX = "You are a careful assistant. Answer briefly and cite the policy section. " * 6


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not installed: `make test` installs Debian's prometheus package "
            "(apt-get install prometheus)"
        )
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dashboard_expressions() -> list[str]:
    """Each panel query with Grafana's variables as a user in namespace servegate sets them."""
    from tests.deploy.test_dashboard import expressions, load, substitute

    return [substitute(e) for e in expressions(load())]


def adapter_expressions() -> list[str]:
    """Each external rule's seriesQuery and its metricsQuery as the adapter renders it
    for every HPA metric that uses the rule (LabelMatchers from the HPA's selector)."""
    rules = yaml.safe_load((MONITORING / "prometheus-adapter" / "config.yaml").read_text())
    hpas = [
        r
        for overlay in ("vllm", "vllm-gpu-utilization")
        for r in build(OVERLAYS / overlay)
        if r["kind"] == "HorizontalPodAutoscaler"
    ]
    out = []
    for rule in rules["externalRules"]:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"].strip("'"))
        assert series is not None
        out.append(rule["seriesQuery"])
        used = False
        for hpa in hpas:
            for metric in hpa["spec"]["metrics"]:
                external = metric["external"]["metric"]
                if external["name"] != rule["name"]["as"]:
                    continue
                used = True
                matchers = ",".join(
                    f'{k}="{v}"' for k, v in sorted(external["selector"]["matchLabels"].items())
                )
                out.append(
                    rule["metricsQuery"]
                    .replace("<<.Series>>", series.group(0))
                    .replace("<<.LabelMatchers>>", matchers)
                    .replace("<<.GroupBy>>", "")
                )
        assert used, f"no HPA reads {rule['name']['as']}"
    return out


def prometheus_config(gateway: str, sims: list[str], dcgm: str) -> dict[str, Any]:
    labels = {"namespace": "servegate"}
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "servegate",
                "static_configs": [
                    {"targets": [gateway], "labels": {**labels, "pod": "servegate-0"}}
                ],
            },
            {
                "job_name": "model-servers",
                "static_configs": [
                    {
                        "targets": [address],
                        "labels": {**labels, "pod": f"vllm-{i}", "llm_d_engine_type": "vllm"},
                    }
                    for i, address in enumerate(sims)
                ],
            },
            {
                "job_name": "dcgm-exporter",
                "honor_labels": True,
                "static_configs": [{"targets": [dcgm], "labels": {"node": "gpu-node-1"}}],
            },
        ],
    }


@contextlib.asynccontextmanager
async def prometheus(config: dict[str, Any], workdir: Path) -> AsyncIterator[str]:
    binary = tool("prometheus")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 15
            while True:
                if proc.returncode is not None:
                    raise AssertionError((workdir / "prometheus.log").read_text())
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/-/ready") as resp:
                        if resp.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise AssertionError("Prometheus did not become ready in 15 s")
                await asyncio.sleep(0.1)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def load(
    session: aiohttp.ClientSession, url: str, worker: int, counts: dict[str, int]
) -> None:
    """Chat requests; of every ten, one asks the simulators for a 503 (`X-Return-Error`)
    and one names no served model (the gateway's own 404), so the error panels (upstream
    errors, retries, errors answered) have data too."""
    n = 0
    while True:
        faulty = n % 10 in (4, 9)
        headers = {"X-Return-Error": "503"} if n % 10 == 9 else {}
        body = {
            "model": "no-such-model" if n % 10 == 4 else MODEL,
            "messages": [
                {"role": "system", "content": PREFIX},
                {"role": "user", "content": f"question {worker}-{n % 4}"},
            ],
            "max_tokens": 12,
            "stream": n % 2 == 0,
            "stream_options": {"include_usage": True} if n % 2 == 0 else None,
        }
        if body["stream_options"] is None:
            del body["stream_options"]
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            key = f"{'injected ' if faulty else ''}{resp.status}"
            counts[key] = counts.get(key, 0) + 1
        n += 1


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(item["value"][1])) for item in result)


async def test_every_dashboard_and_adapter_query_returns_data(tmp_path: Path) -> None:
    expressions = dashboard_expressions() + adapter_expressions()
    assert len(expressions) >= 25
    async with SimCluster(2, base={**FAST_SIM, "speed": 5.0}) as cluster:
        gpus = [
            Gpu(
                i,
                f"vllm-{i}",
                "servegate",
                "vllm",
                lambda h=handle: 12.0 + 22.0 * h.engine.num_running,
            )
            for i, handle in enumerate(cluster)
        ]
        gateway_cfg = {
            "gateway": {"port": 0, "seed": 1, "access_log": False},
            "pool": {
                "name": POOL,
                "scrape_interval_s": 0.05,
                "health": {"interval_s": 0.1},
                "endpoints": [{"url": u} for u in cluster.urls],
            },
            "outlier_detection": {"enabled": False},  # the injected 503s eject nothing
            # a replica on the scale-out bus, as in the cluster (no peers here: 0 of them)
            "scaleout": {"bind": f"tcp://127.0.0.1:{free_port()}"},
        }
        async with (
            GatewayRunner(gateway_cfg) as gw,
            FakeDcgmExporter(gpus) as dcgm,
            aiohttp.ClientSession() as session,
        ):
            sims = [h.address for h in cluster]
            config = prometheus_config(f"127.0.0.1:{gw.port}", sims, dcgm.address)
            async with prometheus(config, tmp_path) as prom:
                counts: dict[str, int] = {}
                workers = [asyncio.create_task(load(session, gw.url, w, counts)) for w in range(3)]
                pending = {e: "not asked yet" for e in expressions}
                deadline = time.monotonic() + EVALUATION_DEADLINE_S
                try:
                    while pending and time.monotonic() < deadline:
                        await asyncio.sleep(1.0)
                        for expr in list(pending):
                            async with session.get(
                                f"{prom}/api/v1/query", params={"query": expr}
                            ) as resp:
                                answer = await resp.json()
                            if answer["status"] != "success":
                                pending[expr] = f"{answer['errorType']}: {answer['error']}"
                            elif finite(answer["data"]["result"]):
                                del pending[expr]
                            else:
                                pending[expr] = (
                                    f"no finite sample: {answer['data']['result']!r:.200}"
                                )
                finally:
                    for task in workers:
                        task.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                async with session.get(f"{prom}/api/v1/targets") as resp:
                    targets = (await resp.json())["data"]["activeTargets"]
            assert {t["labels"]["job"] for t in targets if t["health"] == "up"} == {
                "servegate",
                "model-servers",
                "dcgm-exporter",
            }
            assert {k for k in counts if not k.startswith("injected")} == {"200"}, counts
            assert {k for k in counts if k.startswith("injected")} == {
                "injected 503",
                "injected 404",
            }, counts
            assert not pending, "\n".join(f"{e}\n    -> {why}" for e, why in pending.items())


def test_shipped_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    """Debian builds Prometheus without Kubernetes service discovery, so the in-cluster
    config is checked with each `kubernetes_sd_configs` swapped for a static target:
    promtool then checks everything else (relabelling regexes, fields, jobs)."""
    promtool = tool("promtool")
    cluster = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    for job in cluster["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["127.0.0.1:9"]}]
    swapped = tmp_path / "in-cluster.yml"
    swapped.write_text(yaml.safe_dump(cluster))
    compose = ROOT / "deploy" / "compose" / "prometheus.yml"
    result = subprocess.run(
        [promtool, "check", "config", str(swapped), str(compose)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
