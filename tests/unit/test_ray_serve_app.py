"""The Ray Serve application's settings and autoscaling policy, without Ray."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from servegate.integrations.ray_serve import (
    ENGINE_LOAD_METRIC,
    POLICY_PATH,
    RayAppSettings,
    decode_app_settings,
    engine_load_policy,
)


def ctx(loads: dict[str, float] | None, target: float = 2.0, current: int = 1) -> Any:
    metrics = None if loads is None else {ENGINE_LOAD_METRIC: loads}
    return SimpleNamespace(
        aggregated_metrics=metrics,
        target_num_replicas=current,
        config=SimpleNamespace(target_ongoing_requests=target),
    )


@pytest.mark.parametrize(
    ("loads", "target", "wanted"),
    [
        (None, 2.0, 1.0),
        ({}, 2.0, 1.0),
        ({"a": 12.0}, 2.0, 6.0),
        ({"a": 3.0, "b": 5.0}, 4.0, 2.0),
        ({"a": 0.0, "b": 0.0}, 4.0, 0.0),
    ],
    ids=["no-metrics-yet", "no-replica-reported", "one-busy", "two-replicas", "idle"],
)
def test_engine_load_policy(loads: dict[str, float] | None, target: float, wanted: float) -> None:
    replicas, state = engine_load_policy(ctx(loads, target))
    assert (replicas, state) == (wanted, {})


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"gatway": {}}, "gatway"),
        ({"model_server": {"engine": {"kind": "docker"}}}, "kind"),
        ({"model_server": {"engine": {"kind": "command", "argv": []}}}, "argv"),
        (
            {"model_server": {"engine": {"kind": "command", "argv": ["x"], "engine": "nope"}}},
            "unknown engine",
        ),
        ({"model_server": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "max_replicas"),
        ({"registry_lease_s": 1, "model_server": {"heartbeat_s": 1}}, "registry_lease_s"),
    ],
    ids=["typo", "unknown-engine-kind", "empty-argv", "unknown-engine", "bounds", "lease"],
)
def test_app_settings_are_strict(args: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        decode_app_settings(args)


def test_gateway_discovers_the_replicas_by_default() -> None:
    settings = RayAppSettings(gateway={"gateway": {"access_log": False}})
    assert settings.gateway_config() == {
        "gateway": {"access_log": False},
        "pool": {"discovery": {"kind": "ray", "registry": "ReplicaRegistry"}},
    }
    own = RayAppSettings(gateway={"pool": {"discovery": {"kind": "ray", "app": "x"}}})
    assert own.gateway_config()["pool"]["discovery"] == {"kind": "ray", "app": "x"}


def test_autoscaling_uses_the_engine_load_policy() -> None:
    config = decode_app_settings({}).model_server.autoscaling.serve_config()
    assert config["policy"] == {"policy_function": POLICY_PATH}
    assert config["min_replicas"] <= config["max_replicas"]
