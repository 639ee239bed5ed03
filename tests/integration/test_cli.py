"""The `servegate` command as a user runs it: real subprocesses."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import orjson

from servegate.testing.cluster import SimCluster
from tests.integration.conftest import FAST_SIM, MODEL, chat

SERVEGATE = [sys.executable, "-m", "servegate.cli"]


async def run(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *SERVEGATE, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_config_check_good_and_bad(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("pool:\n  endpoints:\n  - url: http://127.0.0.1:9\n    model: m\n")
    code, out, _ = await run("config", "check", str(good))
    assert code == 0
    resolved = orjson.loads(out)
    assert resolved["pool"]["endpoints"][0]["url"] == "http://127.0.0.1:9"
    assert "default" in str(resolved["resolved_profiles"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway:\n  prot: 1\n")
    code, _, err = await run("config", "check", str(bad))
    assert code == 2
    assert f"gateway.prot ({bad}:2:3)" in err
    picker = tmp_path / "picker.yaml"
    picker.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: no-such-scorer\n"
    )
    bad_picker = tmp_path / "bad-picker.yaml"
    bad_picker.write_text("picker: picker.yaml\n")
    code, _, err = await run("config", "check", str(bad_picker))
    assert code == 2
    assert "no-such-scorer" in err


async def test_serve_routes_and_stops_on_sigterm() -> None:
    async with SimCluster(2, base=FAST_SIM) as cluster, aiohttp.ClientSession() as session:
        args = [a for url in cluster.urls for a in ("--endpoint", url)]
        proc = await asyncio.create_subprocess_exec(
            *SERVEGATE, "serve", *args, "--host", "127.0.0.1", "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            port = None
            while port is None:
                line = await asyncio.wait_for(proc.stderr.readline(), 30)
                assert line, "gateway exited before listening"
                record = orjson.loads(line)
                if record.get("msg") == "listening":
                    port = record["port"]
            url = f"http://127.0.0.1:{port}"
            for _ in range(100):
                async with session.get(url + "/v1/models") as resp:
                    if MODEL in {m["id"] for m in (await resp.json())["data"]}:
                        break
                await asyncio.sleep(0.05)
            async with session.post(url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-destination-endpoint"] in cluster.addresses
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            assert proc.stdout is not None
            access = [orjson.loads(x) for x in (await proc.stdout.read()).splitlines()]
            assert [a["status"] for a in access if a["path"] == "/v1/chat/completions"] == [200]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
