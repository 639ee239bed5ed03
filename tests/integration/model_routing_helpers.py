"""Two simulated pools behind one gateway, for the model-routing and reload tests."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import wait_for

V1 = "chat-v1"
V2 = "chat-v2"
SIM = {"speed": 100.0, "num_blocks": 256, "block_size": 16, "max_model_len": 1024}
FAST_POOL = {
    "scrape_interval_s": 0.05,
    "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 2},
}


def sim(model: str) -> dict[str, Any]:
    return {**SIM, "model": model}


def pool(name: str, cluster: SimCluster, **extra: Any) -> dict[str, Any]:
    return {"name": name, **FAST_POOL, "endpoints": [{"url": u} for u in cluster.urls], **extra}


def split(public: str, weights: Mapping[str, int], sticky: bool = False) -> dict[str, Any]:
    rewrite: dict[str, Any] = {
        "rules": [
            {
                "matches": [{"model": public}],
                "targets": [{"modelRewrite": m, "weight": w} for m, w in weights.items()],
            }
        ]
    }
    if sticky:
        rewrite["sticky"] = {"header": "x-session-id"}
    return rewrite


async def wait_pools(gw: GatewayRunner, models: Mapping[str, str]) -> None:
    """Every named pool has a ready endpoint serving its model."""

    def ready() -> bool:
        for name, model in models.items():
            runtime = gw.gateway.runtime(name)
            if runtime is None or runtime.pool.ready_count() == 0:
                return False
            if runtime.pool.resolve_model(model) is None:
                return False
        return True

    await wait_for(ready, what=f"pools {sorted(models)} ready")


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, str | None, str | None]:
    """(status, model in the response body, served-model header)."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        data = await resp.json(content_type=None)
        served = data.get("model") if isinstance(data, dict) else None
        return resp.status, served, resp.headers.get("x-servegate-served-model")


async def many(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    n: int,
    concurrency: int = 32,
) -> list[tuple[int, str | None, str | None]]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> tuple[int, str | None, str | None]:
        async with sem:
            return await complete(session, url, model)

    return await asyncio.gather(*(one() for _ in range(n)))


def metric(text: str, name: str, labels: Mapping[str, str]) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
