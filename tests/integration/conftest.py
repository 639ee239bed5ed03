from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner

MODEL = "sim-model"
FAST_SIM = {
    "model": MODEL,
    "speed": 20.0,
    "num_blocks": 256,
    "block_size": 16,
    "max_model_len": 2048,
}


def gateway_config(
    urls: list[str], picker: dict[str, Any] | None = None, **gateway: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 7, "port": 0, **gateway},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 2},
            "endpoints": [{"url": u} for u in urls],
        },
    }
    if picker is not None:
        cfg["picker"] = picker
    return cfg


async def wait_for(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_ready(gw: GatewayRunner, n: int) -> None:
    pool = gw.gateway.pool
    await wait_for(
        lambda: (
            pool.ready_count() == n
            and pool.resolve_model(MODEL) is not None
            and all(s.metrics.scraped_at > 0 for s in pool)
        ),
        what=f"{n} ready endpoints",
    )


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    async with SimCluster(3, base=FAST_SIM) as c:
        yield c


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def gateway(cluster: SimCluster) -> AsyncIterator[GatewayRunner]:
    async with GatewayRunner(gateway_config(cluster.urls, debug_headers=True)) as gw:
        await wait_ready(gw, len(cluster))
        yield gw


def chat(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


PICKER_HEAD = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}


def single_scorer_picker(scorer: str) -> dict[str, Any]:
    return {**PICKER_HEAD, "plugins": [{"type": scorer}, {"type": "max-score-picker"}]}
