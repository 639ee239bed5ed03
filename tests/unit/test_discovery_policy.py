"""InferenceObjectives and InferenceModelRewrites read from the cluster (FakeKubeApi over
real HTTP, through kubernetes-asyncio), and how they merge with the config's.

Every wait is bounded by one second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servegate.pool.discovery import start_discovery
from servegate.pool.discovery.kubernetes import KubernetesDiscovery
from servegate.pool.discovery.policy import ClusterPolicy, merge_rewrites
from servegate.pool.discovery.settings import KubernetesDiscoverySettings
from servegate.pool.pool import Pool
from servegate.rewrites import ModelRewrite
from servegate.testing.kubeapi import X_GROUP, X_VERSION, FakeKubeApi

POOL = "qwen-pool"
APP = {"app": "vllm"}


async def follows(predicate: Callable[[], bool], what: str, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not followed within {timeout} s: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(namespace="llm", token="s3cret", bookmark_interval_s=0.2) as fake:
        yield fake


async def discover(
    api: FakeKubeApi, tmp_path: Path, **extra: Any
) -> tuple[KubernetesDiscovery, ClusterPolicy]:
    settings = KubernetesDiscoverySettings.model_validate(
        {
            "kind": "kubernetes",
            "kubeconfig": str(api.write_kubeconfig(tmp_path / "kc")),
            "selector": {"matchLabels": APP},
            "target_ports": [8000],
            "backoff_initial_s": 0.02,
            "backoff_max_s": 0.1,
            "watch_timeout_s": 5,
            **extra,
        }
    )
    discovery = await start_discovery(settings, Pool(POOL))
    assert isinstance(discovery, KubernetesDiscovery)
    assert discovery.policy is not None
    return discovery, discovery.policy


def splits(policy: ClusterPolicy) -> dict[str, dict[str, int]]:
    return {
        match.model: {t.target: t.weight for t in rule.targets}
        for rewrite in policy.rewrites
        for rule in rewrite.rules
        for match in rule.matches
    }


async def test_objectives_of_this_pool_are_read_followed_and_dropped(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.set_objective("interactive", 10, POOL)
    api.set_objective("default-priority", None, POOL)
    api.set_objective("elsewhere", 7, "another-pool")
    discovery, policy = await discover(api, tmp_path)
    try:
        await follows(lambda: bool(policy.objectives), "first list")
        assert policy.objectives == {"interactive": 10, "default-priority": 0}
        api.set_objective("batch", -1, POOL)
        await follows(lambda: policy.objectives.get("batch") == -1, "batch added")
        api.set_objective("interactive", 20, POOL)
        await follows(lambda: policy.objectives["interactive"] == 20, "priority changed")
        api.delete_objective("default-priority")
        await follows(lambda: "default-priority" not in policy.objectives, "deleted")
        api.set_objective("batch", -1, "another-pool")  # moved away from this pool
        await follows(lambda: "batch" not in policy.objectives, "moved to another pool")
        assert policy.objectives == {"interactive": 20}
    finally:
        await discovery.stop()


async def test_model_rewrites_are_read_followed_and_dropped(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.set_model_rewrite("alias", POOL, "qwen", {"qwen3-8b": None})
    discovery, policy = await discover(api, tmp_path)
    try:
        await follows(lambda: bool(policy.rewrites), "first list")
        assert splits(policy) == {"qwen": {"qwen3-8b": 1}}
        assert {r.pool_ref for r in policy.rewrites} == {POOL}
        api.set_model_rewrite("alias", POOL, "qwen", {"qwen3-8b": 90, "qwen3-8b-canary": 10})
        await follows(lambda: len(splits(policy)["qwen"]) == 2, "split added")
        assert splits(policy) == {"qwen": {"qwen3-8b": 90, "qwen3-8b-canary": 10}}
        api.delete_model_rewrite("alias")
        await follows(lambda: not policy.rewrites, "deleted")
    finally:
        await discovery.stop()


async def test_objects_deleted_while_the_watch_expired_leave_on_the_relist(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.set_objective("batch", -1, POOL)
    api.set_model_rewrite("alias", POOL, "qwen", {"qwen3-8b": None})
    discovery, policy = await discover(api, tmp_path)
    try:
        await follows(lambda: bool(policy.objectives and policy.rewrites), "first list")
        api.pause()
        api.delete_objective("batch")
        api.delete_model_rewrite("alias")
        api.expire()
        await follows(lambda: not policy.objectives and not policy.rewrites, "relisted")
        assert api.lists("inferenceobjectives") == 2
        assert api.lists("inferencemodelrewrites") == 2
        api.set_objective("batch", -2, POOL)  # the new watch works
        await follows(lambda: policy.objectives == {"batch": -2}, "watch resumed")
    finally:
        await discovery.stop()


async def test_a_cluster_without_the_crds_has_none_and_pods_still_join(tmp_path: Path) -> None:
    async with FakeKubeApi(namespace="llm", crds=("inferencepools",)) as api:
        api.add_pod("a", "10.0.0.1", APP, ready=True)
        discovery, policy = await discover(api, tmp_path)
        try:
            assert await discovery.wait_synced(1.0)
            await follows(
                lambda: all(r.absent and r.synced.is_set() for r in discovery.policy_reflectors),
                "404s seen",
            )
            assert len(discovery.pool) == 1
            assert policy.objectives == {} and policy.rewrites == ()
            assert all(r.stats.errors == 0 for r in discovery.policy_reflectors)
        finally:
            await discovery.stop()


async def test_an_object_that_does_not_parse_is_left_out_alone(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.set_objective("good", 5, POOL)
    bad = api.set_objective("bad", 1, POOL)
    bad["spec"]["priority"] = "high"  # what a CRD without validation would let through
    api.objects["inferenceobjectives"]["bad"] = bad
    api.set_model_rewrite("no-targets", POOL, "m", {})
    discovery, policy = await discover(api, tmp_path)
    try:
        # both kinds' first lists, not just the objectives' (they sync independently)
        await follows(
            lambda: all(r.synced.is_set() for r in discovery.policy_reflectors), "first lists"
        )
        assert policy.objectives == {"good": 5}
        assert set(policy.rejected) == {
            "InferenceObjective/bad",
            "InferenceModelRewrite/no-targets",
        }
    finally:
        await discovery.stop()


async def test_watches_can_be_turned_off(api: FakeKubeApi, tmp_path: Path) -> None:
    api.set_objective("batch", -1, POOL)
    discovery, policy = await discover(api, tmp_path, watch_model_rewrites=False)
    try:
        await follows(lambda: bool(policy.objectives), "objectives read")
        assert api.lists("inferencemodelrewrites") == 0
        assert len(discovery.policy_reflectors) == 1
    finally:
        await discovery.stop()


async def test_the_fake_serves_them_as_the_api_server_does(api: FakeKubeApi) -> None:
    api.set_objective("batch", -1, POOL)
    headers = {"Authorization": "Bearer s3cret"}
    base = f"{api.url}/apis/{X_GROUP}/{X_VERSION}/namespaces/llm"
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base}/inferenceobjectives") as resp:
            doc = await resp.json()
        assert doc["kind"] == "InferenceObjectiveList"
        assert doc["apiVersion"] == f"{X_GROUP}/{X_VERSION}"
        assert doc["metadata"]["resourceVersion"].isdigit()
        (item,) = doc["items"]
        assert item["spec"] == {
            "priority": -1,
            "poolRef": {
                "group": "inference.networking.k8s.io",
                "kind": "InferencePool",
                "name": POOL,
            },
        }
        assert item["metadata"]["generation"] == 1
        for wrong in (
            f"{api.url}/apis/{X_GROUP}/v1alpha1/namespaces/llm/inferenceobjectives",
            f"{api.url}/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencemodelrewrites",
        ):
            async with session.get(wrong) as resp:
                assert resp.status == 404
                assert (await resp.json())["reason"] == "NotFound"


def rewrite(name: str, model: str | None, target: str) -> ModelRewrite:
    rule: dict[str, Any] = {"targets": [{"modelRewrite": target}]}
    if model is not None:
        rule["matches"] = [{"model": {"type": "Exact", "value": model}}]
    return ModelRewrite.model_validate({"name": name, "rules": [rule]})


def test_the_config_then_the_oldest_rewrite_wins_a_model() -> None:
    config = (rewrite("config", "a", "from-config"),)
    cluster = [
        rewrite("old", "a", "from-old"),
        rewrite("old-b", "b", "b-old"),
        rewrite("new-b", "b", "b-new"),
        rewrite("any", None, "fallback"),
        rewrite("any-2", None, "second-fallback"),
    ]
    merged, dropped = merge_rewrites(config, cluster)
    targets = {
        (r.name, m.model if m else None): rule.targets[0].target
        for r in merged
        for rule in r.rules
        for m in (rule.matches or (None,))
    }
    assert targets == {
        ("config", "a"): "from-config",
        ("old-b", "b"): "b-old",
        ("any", None): "fallback",
    }
    assert len(dropped) == 3


def test_policy_orders_rewrites_oldest_first() -> None:
    policy = ClusterPolicy(POOL, POOL)
    seen: list[int] = []
    policy.listen("test", lambda: seen.append(policy.changes))

    def obj(name: str, created: str, target: str) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {
                "poolRef": {"name": POOL},
                "rules": [
                    {"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": target}]}
                ],
            },
        }

    policy.replacer("InferenceModelRewrite")(
        [
            obj("z-older", "2026-01-01T00:00:00Z", "old"),
            obj("a-newer", "2026-02-01T00:00:00Z", "new"),
        ]
    )
    assert [r.name for r in policy.rewrites] == ["z-older", "a-newer"]
    merged, _ = merge_rewrites((), policy.rewrites)
    assert [r.name for r in merged] == ["z-older"]
    policy.replacer("InferenceModelRewrite")(
        [
            obj("z-older", "2026-01-01T00:00:00Z", "old"),
            obj("a-newer", "2026-02-01T00:00:00Z", "new"),
        ]
    )
    assert seen == [1]  # the same objects again: no change, no call
