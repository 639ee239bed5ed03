from __future__ import annotations

from typing import Any

import pytest

from servegate.config import ConfigError, parse_config
from servegate.scaleout.settings import WORKER_ENV, ScaleOutSettings, WorkerIdentity


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"workers": 0}, "greater than or equal to 1"),
        ({"bind": "http://0.0.0.0:7700"}, "is not tcp://host:port"),
        ({"bind": "tcp://0.0.0.0"}, "is not tcp://host:port"),
        ({"bind": "tcp://a:1", "peers": ["tcp://b"]}, "is not tcp://host:port"),
        ({"peers": ["tcp://b:1"]}, "need scaleout.bind"),
        ({"peer_service": "svc"}, "need scaleout.bind"),
        ({"heartbeat_s": 2.0, "expiry_s": 1.0}, "longer than"),
        ({"replica_id": "a b"}, "should match pattern"),
        ({"workerz": 2}, "unknown field"),
    ],
    ids=[
        "no-workers", "bind-scheme", "bind-port", "peer-port", "peers-no-bind", "service-no-bind",
        "expiry", "replica-id", "unknown-key",
    ],
)  # fmt: skip
def test_bad_scaleout_settings_are_refused_with_a_clear_message(
    doc: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config("", environ={}, overrides={"scaleout": doc})


def test_defaults_change_nothing() -> None:
    cfg = parse_config("", environ={})
    assert cfg.scaleout == ScaleOutSettings()
    assert cfg.scaleout.workers == 1 and not cfg.scaleout.replicates


def test_worker_identity_round_trips_through_the_environment() -> None:
    identity = WorkerIdentity(
        index=1, origin="r/w1.2", replica_id="r", hub_in="ipc:///t/in", hub_out="ipc:///t/out",
        config_path="/t/config.json", config_dir=None, config_file="/etc/sg.yaml",
        overrides={"gateway": {"port": 8080}},
    )  # fmt: skip
    assert WorkerIdentity.from_env({WORKER_ENV: identity.to_env()}) == identity
    assert not identity.leader
    assert WorkerIdentity.from_env({}) is None


@pytest.mark.parametrize(
    "raw", ["not json", "{}", '{"index": "x"}'], ids=["text", "empty", "types"]
)
def test_a_bad_worker_identity_is_a_clear_error(raw: str) -> None:
    with pytest.raises(ValueError, match=WORKER_ENV):
        WorkerIdentity.from_env({WORKER_ENV: raw})
