"""schemathesis against /openapi.json: no input may make the gateway itself answer 5xx.

The gateway runs in a thread of its own (schemathesis calls it synchronously)
in front of one simulated replica. Every operation gets positive and negative
examples; `model` is pinned to the served model so valid requests really
reach the replica, and `max_tokens` is capped so they stay short.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from servegate.gateway.openapi import openapi_document
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, MODEL, gateway_config, wait_ready

ADMIN_KEY = "admin-secret"


UNTESTED_HEADERS = {"x-gateway-destination-endpoint-subset"}
"""A subset naming no pool member is answered 503 by the Endpoint Picker Protocol itself
(documented); test_llmd_routes.py covers it."""


def _tested_document() -> dict[str, Any]:
    doc = copy.deepcopy(openapi_document())
    for ops in doc["paths"].values():
        for op in ops.values():
            params = op.get("parameters")
            if params is not None:
                op["parameters"] = [p for p in params if p["name"] not in UNTESTED_HEADERS]
    for schema in doc["components"]["schemas"].values():
        props = schema.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [MODEL]}
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props:
                props[name] = {"type": "integer", "minimum": 0, "maximum": 16}
    return doc


SCHEMA = schemathesis.openapi.from_dict(_tested_document())


class ThreadedGateway:
    """A simulated replica and a gateway on an event loop in a background thread."""

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with SimCluster(1, base=FAST_SIM) as cluster:
            cfg = gateway_config(cluster.urls, admin_keys=[ADMIN_KEY], max_body_bytes=65536)
            async with GatewayRunner(cfg) as gw:
                await wait_ready(gw, 1)
                self.url = gw.url
                self._ready.set()
                await self._stop.wait()

    def __enter__(self) -> ThreadedGateway:
        self._thread.start()
        if not self._ready.wait(30.0) or self._error is not None:
            raise RuntimeError(f"gateway did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30.0)


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    with ThreadedGateway() as gw:
        yield gw.url


@SCHEMA.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_input_makes_the_gateway_answer_5xx(case: schemathesis.Case, gateway_url: str) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if case.path.startswith("/admin") else None
    response = case.call(base_url=gateway_url, headers=headers, timeout=10)
    case.validate_response(response, checks=[not_a_server_error])
