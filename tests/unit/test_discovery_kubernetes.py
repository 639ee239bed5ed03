"""Kubernetes discovery over real HTTP against `FakeKubeApi`, through kubernetes-asyncio.

Every wait is bounded by one second: the pool must follow the API within that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import certifi
import pytest

from servegate.config import ConfigError
from servegate.pool.discovery import start_discovery
from servegate.pool.discovery.kubeapi import connect
from servegate.pool.discovery.kubernetes import KubernetesDiscovery
from servegate.pool.discovery.settings import KubernetesDiscoverySettings
from servegate.pool.endpoint import Role
from servegate.pool.pool import Pool
from servegate.testing.kubeapi import FakeKubeApi

APP = {"app": "vllm"}


async def follows(predicate: Callable[[], bool], what: str, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"pool did not follow within {timeout} s: {what}")
        await asyncio.sleep(0.01)


def addresses(pool: Pool) -> set[str]:
    return {s.address for s in pool}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(namespace="llm", token="s3cret", bookmark_interval_s=0.2) as fake:
        yield fake


def settings(kubeconfig: Path, **extra: Any) -> KubernetesDiscoverySettings:
    doc: dict[str, Any] = {
        "kind": "kubernetes",
        "kubeconfig": str(kubeconfig),
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.1,
        "watch_timeout_s": 5,
        # the pod tests count requests and injected failures: no objective/rewrite watches
        "watch_objectives": False,
        "watch_model_rewrites": False,
        **extra,
    }
    if "inference_pool" not in extra:
        doc.setdefault("selector", {"matchLabels": APP})
        doc.setdefault("target_ports", [8000])
    return KubernetesDiscoverySettings.model_validate(doc)


@pytest.fixture
async def running(
    api: FakeKubeApi, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[KubernetesDiscovery, Pool]]:
    extra = getattr(request, "param", {})
    pool = Pool()
    discovery = await start_discovery(
        settings(api.write_kubeconfig(tmp_path / "kc"), **extra), pool
    )
    assert isinstance(discovery, KubernetesDiscovery)
    yield discovery, pool
    await discovery.stop()


async def test_pods_appear_become_ready_change_labels_and_vanish(
    api: FakeKubeApi, running: tuple[KubernetesDiscovery, Pool]
) -> None:
    discovery, pool = running
    assert discovery.namespace == "llm"  # from the kubeconfig context
    api.add_pod("vllm-0", "10.0.0.1", APP)
    api.add_pod("vllm-1", "10.0.0.2", APP, ready=True)
    api.add_pod("sglang-0", "10.0.0.9", {"app": "sglang"}, ready=True)
    await follows(lambda: addresses(pool) == {"10.0.0.2:8000"}, "only the ready, selected pod")

    api.set_ready("vllm-0", True)
    await follows(lambda: addresses(pool) == {"10.0.0.1:8000", "10.0.0.2:8000"}, "vllm-0 ready")

    api.set_labels("vllm-0", {**APP, "llm-d.ai/role": "decode", "llm-d.ai/model": "qwen"})
    await follows(
        lambda: (s := pool.get("10.0.0.1:8000")) is not None and s.endpoint.role is Role.DECODE,
        "role label followed",
    )
    assert pool.get("10.0.0.1:8000").endpoint.model == "qwen"  # type: ignore[union-attr]

    api.set_ready("vllm-1", False)
    await follows(lambda: addresses(pool) == {"10.0.0.1:8000"}, "vllm-1 not ready")

    api.set_labels("vllm-0", {"app": "elsewhere"})  # leaves the selector: DELETED
    await follows(lambda: len(pool) == 0, "vllm-0 left the selector")

    api.set_labels("vllm-0", APP)  # back in: ADDED
    await follows(lambda: addresses(pool) == {"10.0.0.1:8000"}, "vllm-0 back")
    api.terminate_pod("vllm-0")
    await follows(lambda: len(pool) == 0, "terminating pod out at once")
    api.delete_pod("vllm-0")
    api.delete_pod("vllm-1")
    await asyncio.sleep(0.05)
    assert len(pool) == 0
    assert discovery.stats.lists == 1  # all of it through one watch


@pytest.mark.parametrize("gone_as", ["event", "status"])
async def test_watch_expiry_410_relists_and_drops_pods_deleted_meanwhile(
    tmp_path: Path, gone_as: str
) -> None:
    async with FakeKubeApi(namespace="llm", gone_as=gone_as) as api:
        api.add_pod("a", "10.0.0.1", APP, ready=True)
        api.add_pod("b", "10.0.0.2", APP, ready=True)
        pool = Pool()
        discovery = await start_discovery(settings(api.write_kubeconfig(tmp_path / "kc")), pool)
        assert isinstance(discovery, KubernetesDiscovery)
        try:
            await follows(lambda: len(pool) == 2, "initial list")
            api.pause()  # the watch misses what follows
            api.delete_pod("a")
            api.add_pod("c", "10.0.0.3", APP, ready=True)
            if gone_as == "status":
                api.expire()
                api.close_watches()
            else:
                api.expire()
            await follows(
                lambda: addresses(pool) == {"10.0.0.2:8000", "10.0.0.3:8000"}, "relist after 410"
            )
            assert discovery.stats.gone >= 1
            assert api.lists() == 2
            api.add_pod("d", "10.0.0.4", APP, ready=True)  # and the new watch works
            await follows(lambda: "10.0.0.4:8000" in addresses(pool), "watch after relist")
        finally:
            await discovery.stop()


@pytest.mark.parametrize("running", [{"target_ports": [8000, 8001, 8002]}], indirect=True)
async def test_several_target_ports_are_data_parallel_ranks(
    api: FakeKubeApi, running: tuple[KubernetesDiscovery, Pool]
) -> None:
    _, pool = running
    api.add_pod("dp", "10.0.0.1", APP, ready=True, annotations={"servegate.io/kv-events": "5557"})
    await follows(lambda: len(pool) == 3, "three ranks")
    assert sorted((s.address, s.endpoint.kv_events) for s in pool) == [
        ("10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        ("10.0.0.1:8001", "tcp://10.0.0.1:5558"),
        ("10.0.0.1:8002", "tcp://10.0.0.1:5559"),
    ]


async def test_a_reused_pod_ip_is_not_dropped_by_the_old_pods_late_delete(
    api: FakeKubeApi, running: tuple[KubernetesDiscovery, Pool]
) -> None:
    _, pool = running
    api.add_pod("old", "10.0.0.7", APP, ready=True)
    await follows(lambda: len(pool) == 1, "old pod")
    api.add_pod("new", "10.0.0.7", {**APP, "llm-d.ai/role": "decode"}, ready=True)
    await follows(
        lambda: (s := pool.get("10.0.0.7:8000")) is not None and s.endpoint.role is Role.DECODE,
        "new pod owns the address",
    )
    api.delete_pod("old")
    await asyncio.sleep(0.1)
    assert addresses(pool) == {"10.0.0.7:8000"}
    api.delete_pod("new")
    await follows(lambda: len(pool) == 0, "new pod gone")


@pytest.mark.parametrize("running", [{"inference_pool": "qwen"}], indirect=True)
async def test_inference_pool_selector_and_ports_are_followed(
    api: FakeKubeApi, running: tuple[KubernetesDiscovery, Pool]
) -> None:
    discovery, pool = running
    api.add_pod("q0", "10.0.1.1", {"app": "qwen"}, ready=True)
    api.add_pod("l0", "10.0.2.1", {"app": "llama"}, ready=True)
    await asyncio.sleep(0.1)
    assert len(pool) == 0  # no InferencePool yet: nothing is selected

    api.set_inference_pool("qwen", {"app": "qwen"}, (8000,))
    await follows(lambda: addresses(pool) == {"10.0.1.1:8000"}, "pool created")

    api.set_inference_pool("qwen", {"app": "qwen"}, (8000, 8001))
    await follows(lambda: addresses(pool) == {"10.0.1.1:8000", "10.0.1.1:8001"}, "second port")

    api.set_inference_pool("qwen", {"app": "llama"}, (8000,))
    await follows(lambda: addresses(pool) == {"10.0.2.1:8000"}, "new selector")
    assert discovery.restarts == 2

    api.delete_inference_pool("qwen")
    await follows(lambda: len(pool) == 0, "pool deleted")
    api.set_inference_pool("qwen", {"app": "qwen"}, (9000,))
    await follows(lambda: addresses(pool) == {"10.0.1.1:9000"}, "pool recreated")
    pool_requests = [q for p, q in api.requests if p.endswith("/inferencepools")]
    assert pool_requests[0] == {"fieldSelector": "metadata.name=qwen"}
    assert all(
        p.startswith("/apis/inference.networking.k8s.io/v1/")
        for p, _ in api.requests
        if "pools" in p
    )


async def test_a_failing_api_is_retried(api: FakeKubeApi, tmp_path: Path) -> None:
    api.fail_next = [500, 503]
    api.add_pod("a", "10.0.0.1", APP, ready=True)
    pool = Pool()
    discovery = await start_discovery(settings(api.write_kubeconfig(tmp_path / "kc")), pool)
    assert isinstance(discovery, KubernetesDiscovery)
    try:
        assert await discovery.wait_synced(1.0)
        assert len(pool) == 1
        assert discovery.stats.errors == 2
    finally:
        await discovery.stop()


async def test_a_wrong_token_is_refused_and_nothing_joins(api: FakeKubeApi, tmp_path: Path) -> None:
    api.add_pod("a", "10.0.0.1", APP, ready=True)
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    kubeconfig.write_text(kubeconfig.read_text().replace("s3cret", "wrong"))
    pool = Pool()
    discovery = await start_discovery(settings(kubeconfig), pool)
    assert isinstance(discovery, KubernetesDiscovery)
    try:
        await follows(lambda: discovery.stats.errors >= 2, "401s counted")
        assert len(pool) == 0
    finally:
        await discovery.stop()


async def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pool\.discovery: cannot load Kubernetes credentials"):
        await start_discovery(settings(tmp_path / "missing"), Pool())


async def test_in_cluster_config_uses_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubernetes_asyncio.config import incluster_config

    token = tmp_path / "token"
    token.write_text("sa-token")
    namespace = tmp_path / "namespace"
    namespace.write_text("serving\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", certifi.where())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    connection = await connect(None, None, None, namespace_file=str(namespace))
    try:
        assert connection.source == "in-cluster"
        assert connection.namespace == "serving"
        configuration = connection.api._client.configuration  # type: ignore[attr-defined]
        assert configuration.host == "https://127.0.0.1:6443"
        assert configuration.ssl_ca_cert == certifi.where()
        assert await configuration.get_api_key_with_prefix("BearerToken") == "Bearer sa-token"
    finally:
        await connection.api.close()
