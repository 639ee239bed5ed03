"""Build `EndpointState` objects for tests, examples and benchmarks.

`endpoint_state` makes one healthy endpoint with the metrics you name;
`random_endpoint_states` makes a pool-sized list with varied, reproducible load.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from servegate.pool.endpoint import (
    ROLE_LABEL,
    Endpoint,
    EndpointMetrics,
    EndpointState,
    LoraInfo,
    Role,
)


def endpoint_state(
    address: str = "10.0.0.1:8000",
    *,
    waiting: float = 0.0,
    running: float = 0.0,
    kv_usage: float = 0.0,
    lora: LoraInfo | None = None,
    scraped_at: float = 1.0,
    in_flight_requests: int = 0,
    in_flight_tokens: int = 0,
    labels: Mapping[str, str] | None = None,
    role: Role = Role.BOTH,
    engine: str = "vllm",
    model: str | None = None,
    healthy: bool = True,
) -> EndpointState:
    """A healthy endpoint at `address` whose metrics were scraped at `scraped_at`."""
    endpoint = Endpoint(
        address=address,
        url=f"http://{address}",
        engine=engine,
        role=role,
        model=model,
        labels=MappingProxyType(dict(labels or {})),
    )
    metrics = EndpointMetrics(
        waiting=waiting, running=running, kv_usage=kv_usage, lora=lora, scraped_at=scraped_at
    )
    return EndpointState(
        endpoint=endpoint,
        metrics=metrics,
        healthy=healthy,
        in_flight_requests=in_flight_requests,
        in_flight_tokens=in_flight_tokens,
    )


def addresses(n: int, port: int = 8000) -> list[str]:
    """`n` distinct `host:port` addresses: 10.0.0.1:8000, 10.0.0.2:8000, …"""
    return [f"10.0.{i // 250}.{i % 250 + 1}:{port}" for i in range(n)]


def random_endpoint_states(
    n: int,
    rng: random.Random | None = None,
    *,
    now: float = 100.0,
    roles: Iterable[Role] | None = None,
) -> list[EndpointState]:
    """`n` endpoints with random queue, running, KV usage and in-flight load, all fresh.

    With `roles`, endpoints take those roles in turn (and carry the matching
    `llm-d.ai/role` label), for disaggregated pools.
    """
    rng = rng or random.Random(0)
    cycle = list(roles) if roles is not None else []
    out = []
    for i, address in enumerate(addresses(n)):
        role = cycle[i % len(cycle)] if cycle else Role.BOTH
        labels = {ROLE_LABEL: role.value} if cycle else {}
        running = rng.randint(0, 64)
        out.append(
            endpoint_state(
                address,
                waiting=float(rng.randint(0, 20)),
                running=float(running),
                kv_usage=rng.random(),
                scraped_at=now - rng.random(),
                in_flight_requests=rng.randint(0, 32),
                in_flight_tokens=rng.randint(0, 200_000),
                labels=labels,
                role=role,
            )
        )
    return out
