"""Issue 18, tenancy: a key fixes its tenant's fairness id, priority ceiling and rate
limits, whatever the request's headers claim; keys come from files or the environment
and are never logged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servegate.config import ConfigError, parse_config
from servegate.gateway.tenants import Bucket, Tenant, TenantTable
from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
FLOW = {"x-llm-d-inference-fairness-id": "someone-else", "x-llm-d-inference-objective": "vip"}


def tenants_config(replica: Replica, key_file: Path, **tenant: Any) -> dict[str, Any]:
    cfg = gateway_config([replica.url], api_keys=["plain-key"])
    cfg["tenants"] = [
        {"name": "team-a", "key_files": [str(key_file)], "max_priority": 0, **tenant},
        {"name": "team-b", "key_env": ["TEAM_B_KEY"]},
    ]
    cfg["flow_control"] = {
        "enabled": True,
        "objectives": [{"name": "vip", "priority": 100}],
    }
    return cfg


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "team-a.keys"
    path.write_text("# team a\nsk-team-a-1\n\nsk-team-a-2\n")
    return path


async def test_a_tenant_key_fixes_fairness_and_caps_priority(
    http: aiohttp.ClientSession,
    key_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEAM_B_KEY", "sk-team-b")
    replica = await Replica().start()
    try:
        async with GatewayRunner(tenants_config(replica, key_file)) as gw:
            await ready(gw, 1)
            for key in ("sk-team-a-2", "sk-team-b", "plain-key"):
                async with http.post(
                    gw.url + "/v1/chat/completions",
                    json=CHAT,
                    headers={"Authorization": f"Bearer {key}", **FLOW},
                ) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.post(
                gw.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer no"}
            ) as resp:
                assert resp.status == 401
            lines = gw.access_lines()
            log = gw.access_stream.getvalue()
            # the flow each request was admitted under, as flow control's own series show it
            seen = {
                (sample.labels["fairness_id"], int(sample.labels["priority"]))
                for family in text_string_to_metric_families(gw.gateway.metrics.render().decode())
                if family.name == "llm_d_epp_flow_control_request_queue_duration_seconds"
                for sample in family.samples
                if sample.name.endswith("_count") and sample.value > 0
            }
        assert seen == {("team-a", 0), ("team-b", 100), ("someone-else", 100)}
        assert [line.get("tenant") for line in lines] == ["team-a", "team-b", None, None]
        for secret in (b"sk-team-a", b"sk-team-b", b"plain-key"):
            assert secret not in log
        assert all("authorization" not in c.headers for c in replica.calls)
    finally:
        await replica.stop()


async def test_requests_per_minute_is_429_with_retry_after(
    http: aiohttp.ClientSession, key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_B_KEY", "sk-team-b")
    replica = await Replica().start()
    try:
        cfg = tenants_config(replica, key_file, requests_per_minute=2)
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 1)
            statuses = []
            for _ in range(3):
                async with http.post(
                    gw.url + "/v1/chat/completions",
                    json=CHAT,
                    headers={"Authorization": "Bearer sk-team-a-1"},
                ) as resp:
                    statuses.append(resp.status)
                    if resp.status == 429:
                        error = (await resp.json())["error"]
                        assert (error["type"], error["code"]) == (
                            "rate_limit_error",
                            "rate_limit_exceeded",
                        )
                        assert 1 <= int(resp.headers["Retry-After"]) <= 30
            assert statuses == [200, 200, 429]
            async with http.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": "Bearer sk-team-b"},
            ) as resp:
                assert resp.status == 200  # another tenant's budget
        assert len(replica.calls) == 3
    finally:
        await replica.stop()


def test_token_bucket_arithmetic() -> None:
    now = [0.0]
    tenant = Tenant("t", "t", None, tokens=Bucket(600), clock=lambda: now[0])
    tenant.admit(500)
    with pytest.raises(Exception, match="tokens per minute") as info:
        tenant.admit(200)
    assert info.value.retry_after_s == pytest.approx(10.0)  # type: ignore[attr-defined]
    now[0] = 10.0
    tenant.admit(200)
    tenant.settle(200, 800)  # the replica reported more than estimated: debt
    now[0] = 20.0
    with pytest.raises(Exception, match="tokens per minute"):
        tenant.admit(1)


@pytest.mark.parametrize(
    ("tenant", "environ", "message"),
    [
        pytest.param({"name": "a"}, {}, "has no keys", id="no-keys"),
        pytest.param({"name": "a", "key_env": ["NOPE"]}, {}, "NOPE is unset", id="env-unset"),
        pytest.param({"name": "a", "key_files": ["/nonexistent/k"]}, {}, "cannot read", id="no-file"),
        pytest.param({"name": "a", "keys": [""]}, {}, "blank or padded", id="blank-inline"),
        pytest.param({"name": "a", "key_env": ["K"]}, {"K": "plain-key"}, "twice", id="dup-key"),
    ],
)  # fmt: skip
def test_tenant_key_problems_fail_the_config(
    tenant: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    overrides = {"gateway": {"api_keys": ["plain-key"]}, "tenants": [tenant]}

    def load() -> TenantTable:
        cfg = parse_config("", "<test>", environ={}, overrides=overrides)
        return TenantTable.from_config(cfg, None, environ)

    with pytest.raises(ConfigError, match=message):
        load()


def test_config_check_never_prints_keys(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "gateway:\n  api_keys: [sk-plain-secret]\n"
        "tenants:\n- name: a\n  keys: [sk-inline-secret]\n  requests_per_minute: 5\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "servegate.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "sk-plain-secret" not in done.stdout
    assert "sk-inline-secret" not in done.stdout
    assert '"requests_per_minute":5' in done.stdout.replace(" ", "")
