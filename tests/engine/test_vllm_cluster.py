"""Settings of the real-vLLM runner: impossible clusters are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from servegate.testing.tinymodel import TinyModel
from servegate.testing.vllm_cluster import ClusterSettings, VllmCluster


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas must be at least 1"),
        ({"block_size": 16}, "multiple of 32"),
        # 32 blocks x 32 tokens = 1024 < 2048
        ({"num_blocks": 32}, "must cover max_model_len 2048"),
    ],
    ids=["no-replicas", "block-16", "cache-smaller-than-context"],
)
def test_bad_settings_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSettings(**kwargs)  # type: ignore[arg-type]


def test_servers_get_distinct_ports_endpoints_and_topics(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    cluster = VllmCluster(tiny_model, ClusterSettings(replicas=3), tmp_path)
    try:
        assert len({s.port for s in cluster}) == 3
        assert len({s.kv_bind for s in cluster}) == 3
        assert [s.topic for s in cluster] == [f"kv@127.0.0.1:{s.port}@tiny" for s in cluster]
        command = cluster[0].command()
        for flag, value in [
            ("--block-size", "32"),
            ("--num-gpu-blocks-override", "128"),
            ("--max-loras", "2"),
            ("--served-model-name", "tiny"),
        ]:
            assert command[command.index(flag) + 1] == value
        assert "--enable-prefix-caching" in command
        env = cluster[1].environment()
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
        assert env["HF_HUB_OFFLINE"] == "1"
    finally:
        cluster.stop()


def test_tcp_transport_binds_a_wildcard_and_connects_to_loopback(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    cluster = VllmCluster(tiny_model, ClusterSettings(replicas=1, kv_transport="tcp"), tmp_path)
    try:
        server = cluster[0]
        port = server.kv_bind.rsplit(":", 1)[1]
        assert server.kv_bind == f"tcp://*:{port}"
        assert server.kv_connect == f"tcp://127.0.0.1:{port}"
    finally:
        cluster.stop()
