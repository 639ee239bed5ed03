"""The peer routers (vllm-router, sglang-router) started in front of given replicas.

Shared by the benches that compare servegate with them (`bench_real_peers.py`,
`latency_slo.py`), so that every comparison starts the peers the same way: their
`cache_aware` policy, their defaults otherwise, a process group of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from servegate.testing.vllm_cluster import free_port

PEERS = ("vllm-router", "sglang-router")
ROUTER_START_S = 90.0


def peer_command(
    kind: str, peers: Path, port: int, metrics_port: int, urls: Sequence[str]
) -> list[str]:
    """The command line that starts peer `kind` (one of `PEERS`) from folder `peers`.

    Both peers export Prometheus metrics on port 29000 by default, so two of them (or a
    second bench on the machine) would collide: each gets `metrics_port` instead."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
              "--prometheus-port", str(metrics_port)]  # fmt: skip
    if kind == "vllm-router":
        return [str(peers / "vllm-router"), *common, "--worker-urls", *urls]
    if kind == "sglang-router":
        return [str(peers / "sglang-router"), "launch", *common, "--worker-urls", *urls]
    raise ValueError(f"unknown peer router {kind!r}; expected one of {', '.join(PEERS)}")


def missing_peers(kinds: Sequence[str], peers: Path) -> list[str]:
    """The executables of `kinds` that folder `peers` lacks (so a run can fail up front)."""
    return [str(peers / k) for k in kinds if k in PEERS and not (peers / k).is_file()]


@contextlib.asynccontextmanager
async def peer_router(
    kind: str, peers: Path, urls: Sequence[str], workdir: Path, model: str
) -> AsyncIterator[str]:
    """Peer `kind` in front of `urls`, ready once a completion for `model` went through;
    yields its URL, and stops its whole process group on the way out."""
    port = free_port()
    cmd = peer_command(kind, peers, port, free_port(), urls)
    log_path = workdir / f"{kind}.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_S
        async with aiohttp.ClientSession() as session:
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"{kind} exited: {log_path.read_text()[-2000:]}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    body = {"model": model, "prompt": "ready?", "max_tokens": 1}
                    async with session.post(
                        url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=5)
                    ) as resp:
                        if resp.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} not ready: {log_path.read_text()[-2000:]}")
                await asyncio.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
