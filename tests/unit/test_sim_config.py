"""Simulator settings: strict decoding, clear messages, YAML plus overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servegate.simulator.cli import offset_endpoint, replica_configs
from servegate.simulator.config import SimConfig, SimConfigError, load_sim_config, parse_sim_config


def test_defaults_are_valid() -> None:
    cfg = SimConfig()
    assert (cfg.persona, cfg.role, cfg.block_size) == ("vllm", "prefill-decode", 16)
    assert not cfg.lora.enabled and not cfg.kv_events.enabled


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        pytest.param({"num_blocs": 4}, "num_blocs: unknown setting", id="typo-top-level"),
        pytest.param({"costs": {"step_s": 1}}, "costs.step_s: unknown setting", id="typo-nested"),
        pytest.param({"persona": "tgi"}, "persona", id="unknown-persona"),
        pytest.param(
            {"num_blocks": 8, "block_size": 16, "max_model_len": 128},
            "cannot hold one sequence",  # (8 - 1) x 16 = 112 < 128
            id="cache-smaller-than-context",
        ),
        pytest.param(
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024},
            "without chunked prefill",
            id="no-chunking-small-budget",
        ),
        pytest.param({"faults": {"error_kinds": [200]}}, "not an HTTP error status", id="bad-kind"),
        pytest.param({"lora": {"adapters": ["=path"]}}, "has no name", id="lora-no-name"),
        pytest.param({"speed": 0}, "speed", id="zero-speed"),
    ],
)
def test_rejects_with_a_message(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SimConfigError, match="invalid simulator config") as info:
        parse_sim_config(data)
    assert fragment in str(info.value)


def test_role_alias_both() -> None:
    assert parse_sim_config({"role": "both"}).role == "prefill-decode"


def test_lora_adapter_paths() -> None:
    cfg = parse_sim_config({"lora": {"adapters": ["a1", "a2=/models/a2"]}})
    assert cfg.lora.enabled
    assert cfg.lora.adapter_paths() == {"a1": "/adapters/a1", "a2": "/models/a2"}


def test_yaml_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("model: tiny\ncosts:\n  step_overhead_s: 0.5\n  decode_seq_s: 0.1\n")
    cfg = load_sim_config(path, {"port": 9000, "costs": {"decode_seq_s": 0.2}})
    assert (cfg.model, cfg.port) == ("tiny", 9000)
    assert (cfg.costs.step_overhead_s, cfg.costs.decode_seq_s) == (0.5, 0.2)


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(SimConfigError, match="expected a mapping"):
        load_sim_config(path)


@pytest.mark.parametrize(
    ("endpoint", "index", "expected"),
    [
        pytest.param("tcp://*:5557", 2, "tcp://*:5559", id="tcp-port-offset"),
        pytest.param("tcp://*:0", 2, "tcp://*:0", id="tcp-any-port"),
        pytest.param("ipc:///tmp/kv", 1, "ipc:///tmp/kv-1", id="ipc-suffix"),
    ],
)
def test_offset_endpoint(endpoint: str, index: int, expected: str) -> None:
    assert offset_endpoint(endpoint, index) == expected


def test_replicas_take_consecutive_ports() -> None:
    base = parse_sim_config({"port": 8100, "kv_events": {"endpoint": "tcp://*:5557"}})
    configs = replica_configs(base, 3)
    assert [c.port for c in configs] == [8100, 8101, 8102]
    assert [c.kv_events.endpoint for c in configs] == [
        "tcp://*:5557",
        "tcp://*:5558",
        "tcp://*:5559",
    ]
    assert [c.seed for c in configs] == [0, 1, 2]
