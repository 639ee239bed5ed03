"""servegate as a Bento: `bentoml build` of deploy/bentoml, `bentoml serve` of the
built Bento, and OpenAI requests through it to simulated model servers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from servegate.testing.cluster import SimCluster
from tests.backends.conftest import free_port, start, stop_group, wait_ready

pytestmark = pytest.mark.backends

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    return done.stdout.decode()


def build_bento(tmp: Path, env: dict[str, str]) -> str:
    """The Bento's tag; servegate goes in as a wheel built here, offline."""
    source = tmp / "servegate-src"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    ctx = tmp / "bento"
    shutil.copytree(ROOT / "deploy" / "bentoml", ctx)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run([*pip, "-w", str(ctx / "dist"), str(source)], env, tmp)
    out = run([str(BIN / "bentoml"), "build", str(ctx), "-o", "tag"], env, tmp)
    tag = out.strip().splitlines()[-1].strip()
    assert tag.startswith("__tag__:servegate:") or tag.startswith("servegate:"), out
    return tag.removeprefix("__tag__:")


async def test_bento_builds_and_serves(tmp_path: Path) -> None:
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "1"}
    tag = build_bento(tmp_path, env)
    async with SimCluster(2) as sims:
        config = tmp_path / "gateway.yaml"
        config.write_bytes(
            orjson.dumps(
                {
                    "gateway": {"access_log": False},
                    "pool": {"endpoints": [{"url": url} for url in sims.urls]},
                }
            )
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = tmp_path / "bento.log"
        proc = start(
            [str(BIN / "bentoml"), "serve", tag, "--host", "127.0.0.1", "--port", str(port)],
            log,
            {**env, "SERVEGATE_CONFIG": str(config)},
        )
        try:
            await wait_ready(f"{base}/ready", proc, log, timeout_s=120)
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 6,
            }
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                    assert resp.status == 200, data
                    assert data["usage"]["completion_tokens"] == 6
                stream = {**body, "stream": True}
                async with session.post(f"{base}/v1/chat/completions", json=stream) as resp:
                    assert resp.status == 200
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    text = await resp.text()
                    assert text.rstrip().endswith("data: [DONE]")
                async with session.get(f"{base}/v1/models") as resp:
                    models = await resp.json()
                    assert [m["id"] for m in models["data"]] == ["sim-model"]
        finally:
            stop_group(proc, grace_s=30)
