"""A gateway child process: its port from its own log line, start-up failures explained."""

from __future__ import annotations

from pathlib import Path

import pytest

from servegate.bench.gateway_process import GatewayProcess, GatewayStartError, listening_port


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        pytest.param(
            b'{"ts": 1.0, "level": "info", "msg": "listening", "host": "127.0.0.1", '
            b'"port": 40123}\n',
            40123,
            id="listening-line",
        ),
        pytest.param(
            b'{"msg": "starting"}\nnot json "listening"\n{"msg": "listening", "port": 9}\n',
            9,
            id="after-other-lines",
        ),
        pytest.param(b'{"msg": "listening", "port": 0}\n', None, id="port-zero-is-not-bound"),
        pytest.param(b'{"msg": "not listening", "port": 5}\n', None, id="other-message"),
        pytest.param(b'["listening", 5]\n', None, id="not-an-object"),
        pytest.param(b'{"msg": "listening", "port": 5', None, id="half-written"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_listening_port(log: bytes, expected: int | None) -> None:
    assert listening_port(log) == expected


async def test_a_gateway_that_rejects_its_config_fails_with_its_own_message(
    tmp_path: Path,
) -> None:
    config = {
        "gateway": {"host": "127.0.0.1", "port": 0},
        "pool": {"endpoints": [{"url": "http://127.0.0.1:9", "model": "m"}]},
        "picker": {
            "apiVersion": "llm-d.ai/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [{"type": "no-such-scorer"}],
        },
    }
    # The wait ends when the child exits; the bound only stops a start that hangs, so it
    # leaves room for a loaded machine, where importing and exiting took 10 s instead of 1.
    gateway = GatewayProcess("broken", config, tmp_path, replicas=1, startup_timeout_s=120)
    with pytest.raises(GatewayStartError) as info:
        async with gateway:
            pass
    assert "gateway broken exited with 2" in str(info.value)
    assert "no-such-scorer" in str(info.value)
    assert (tmp_path / "broken.yaml").exists()
