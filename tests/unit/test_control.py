"""The data-plane-neutral request path: the lease, the snapshot, the sidecar plan, and that
`control/` stays free of HTTP frameworks."""

from __future__ import annotations

import ast
import dataclasses
import io
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

import servegate.control
from servegate.config import parse_config
from servegate.control.errors import GatewayError, NoEndpoints
from servegate.control.lease import Lease
from servegate.control.upstream import forwarded_elsewhere, sidecar_headers
from servegate.gateway.app import Gateway, build_gateway
from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.scheduling.framework import Decision
from servegate.scheduling.request import RequestKind
from servegate.testing.endpoints import endpoint_state

ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000")


def gateway(**extra: Any) -> Gateway:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 1},
        "pool": {"endpoints": [{"url": f"http://{a}", "model": "m"} for a in ADDRESSES]},
        **extra,
    }
    gw = build_gateway(parse_config("", "<test>", environ={}, overrides=cfg), None, io.BytesIO())
    now = time.monotonic()
    for address in ADDRESSES:
        gw.pool.set_health(address, True)
        gw.pool.set_metrics(address, EndpointMetrics(scraped_at=now))
    return gw


def in_flight(gw: Gateway) -> list[tuple[int, int]]:
    return [(s.in_flight_requests, s.in_flight_tokens) for s in gw.pool]


def test_the_lease_counts_once_moves_with_a_fallback_and_releases_once() -> None:
    gw = gateway()
    runtime = gw.default
    first, second = (gw.pool.get(a) for a in ADDRESSES)
    assert first is not None and second is not None
    lease = Lease(runtime)
    assert runtime.in_flight == 1
    lease.admit()
    lease.bind(first, 7, time.monotonic())
    assert in_flight(gw) == [(1, 7), (0, 0)]
    lease.move(first)  # the primary's own attempt: nothing changes
    assert in_flight(gw) == [(1, 7), (0, 0)]
    lease.move(second)
    assert in_flight(gw) == [(0, 0), (1, 7)]
    lease.release()
    lease.release()
    assert in_flight(gw) == [(0, 0), (0, 0)]
    assert runtime.in_flight == 0
    lease.move(first)  # after the release a late fallback report counts nothing
    assert in_flight(gw) == [(0, 0), (0, 0)]


async def test_a_request_keeps_the_snapshot_it_began_with() -> None:
    gw = gateway()
    director = gw.director
    ctx = director.begin("r", "POST", "/v1/completions", {}, time.monotonic())
    before = gw.snapshot
    gw.swap(dataclasses.replace(before, runtimes=()))  # the next requests see no pool
    body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 2})
    runtime, decision = await director.route(ctx, body, RequestKind.COMPLETION, None)
    assert ctx.snapshot is before and runtime is before.default
    assert decision.endpoint.address in ADDRESSES
    assert sum(s.in_flight_requests for s in before.default.pool) == 1
    director.finish(ctx)
    assert sum(s.in_flight_requests for s in before.default.pool) == 0


async def test_a_failure_after_admission_releases_the_flow_control_slot() -> None:
    gw = gateway()
    director = gw.director
    ctx = director.begin("r", "POST", "/v1/completions", {}, time.monotonic())
    body = orjson.dumps({"model": "m", "prompt": "hi"})
    with pytest.raises(NoEndpoints):
        await director.route(ctx, body, RequestKind.COMPLETION, ("10.9.9.9:1",))
    assert ctx.lease is not None and ctx.lease.admitted and ctx.lease.state is None
    director.fail(ctx, NoEndpoints("x"))
    director.finish(ctx)
    assert gw.default.in_flight == 0
    assert ctx.record.status == 503


def test_sidecar_plan_for_a_proxy_that_forwards_itself() -> None:
    decode, prefill = endpoint_state("10.0.0.2:8200"), endpoint_state("10.0.0.1:8000")
    other = endpoint_state("10.0.0.3:8201")
    p2p = Decision(decode, [], upstream_headers={"x-kv-cache-source-host-port": "10.0.0.9:1"})
    assert forwarded_elsewhere(p2p, [decode]) == (
        ["10.0.0.2:8200"],
        {"x-kv-cache-source-host-port": "10.0.0.9:1"},
    )
    pd = Decision(decode, [], prefill=prefill)
    assert forwarded_elsewhere(pd, [decode]) == (
        ["10.0.0.2:8200"],
        {"x-prefiller-host-port": "10.0.0.1:8000"},
    )
    # data parallelism behind a sidecar: the primary port, naming the rank
    dp = Decision(decode, [other], primary_port=8000)
    assert forwarded_elsewhere(dp, [decode, other]) == (
        ["10.0.0.2:8000", "10.0.0.3:8000"],
        {"x-data-parallel-host-port": "10.0.0.2:8200"},
    )
    assert sidecar_headers(dp) == {"x-data-parallel-host-port": "10.0.0.2:8200"}


def test_the_rank_header_names_the_least_loaded_rank() -> None:
    state = EndpointState(Endpoint(address="10.0.0.1:8000", url="http://10.0.0.1:8000"))
    state.metrics = EndpointMetrics(rank_load={0: 3.0, 1: 1.0})
    decision = Decision(state, [], rank_header=True)
    assert forwarded_elsewhere(decision, [state]) == (
        ["10.0.0.1:8000"],
        {"X-data-parallel-rank": "1"},
    )


def test_control_imports_no_http_or_grpc_framework() -> None:
    root = Path(servegate.control.__file__).parent
    banned = {"aiohttp", "grpc", "envoy", "multidict", "yarl"}
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert found == []


def test_gateway_errors_are_the_control_errors() -> None:
    from servegate.gateway import errors as http_errors

    assert http_errors.GatewayError is GatewayError
    assert http_errors.NoEndpoints is NoEndpoints
