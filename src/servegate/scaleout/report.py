"""What scale-out shares and what it cannot, for operators: `/admin/scaleout` and metrics.

Not shared between processes or replicas, by design: session-affinity bindings,
flow-control queues and their fairness state, retry budgets, outlier ejections
(passive health), operator drains, and the scheduler's tokenisation caches.
Each process decides these from its own traffic.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servegate.gateway.admin import check_admin_key
from servegate.gateway.errors import GatewayError, render

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway
    from servegate.gateway.lifecycle import RunningGateway
    from servegate.scaleout.wiring import ScaleOut

NOT_SHARED = (
    "session-affinity bindings",
    "flow-control queues",
    "retry budgets",
    "outlier ejections",
    "operator drains",
    "prefix insertions made before a process joined",
)


def describe(scaleout: ScaleOut | None) -> dict[str, Any]:
    if scaleout is None:
        return {"enabled": False, "pid": os.getpid()}
    return scaleout.describe(time.monotonic())


def add_scaleout_routes(
    app: web.Application,
    gateway_key: web.AppKey[Gateway],
    running_key: web.AppKey[RunningGateway],
) -> None:
    """`GET /admin/scaleout`: this process's identity, peers, shared counts and counters."""

    async def get_scaleout(request: web.Request) -> web.Response:
        gw = request.app[gateway_key]
        try:
            check_admin_key(gw.config.gateway.admin_keys, request.headers.get("Authorization", ""))
        except GatewayError as exc:
            return render(exc)
        body = orjson.dumps(describe(request.app[running_key].scaleout))
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/admin/scaleout", get_scaleout)


class ScaleOutCollector(Collector):
    def __init__(self, scaleout: ScaleOut) -> None:
        self._s = scaleout

    def collect(self) -> Iterable[Metric]:
        s = self._s
        now = time.monotonic()
        peers = GaugeMetricFamily(
            "servegate_scaleout_peers", "Live peer processes (workers and replicas) heard from."
        )
        peers.add_metric([], len(s.inflight.peers))
        age = GaugeMetricFamily(
            "servegate_scaleout_peer_last_seen_seconds",
            "Seconds since each peer's last in-flight snapshot.",
            labels=["origin"],
        )
        for origin, view in s.inflight.peers.items():
            age.add_metric([origin], now - view.last_seen)
        messages = CounterMetricFamily(
            "servegate_scaleout_messages",
            "Bus messages sent and received by this process.",
            labels=["direction", "kind"],
        )
        for kind, n in s.bus.stats.sent.items():
            messages.add_metric(["sent", kind], n)
        for kind, n in s.bus.stats.received.items():
            messages.add_metric(["received", kind], n)
        invalid = CounterMetricFamily(
            "servegate_scaleout_invalid_messages", "Bus messages dropped as malformed."
        )
        invalid.add_metric([], s.bus.stats.invalid)
        released = CounterMetricFamily(
            "servegate_scaleout_peers_released",
            "Peers dropped (their in-flight counts released), by why.",
            labels=["reason"],
        )
        released.add_metric(["expired"], s.inflight.expired)
        released.add_metric(["gone"], s.inflight.departed)
        scrapes = GaugeMetricFamily(
            "servegate_scaleout_scrapes", "1 when this process scrapes endpoints itself."
        )
        scrapes.add_metric([], 1.0 if s.metrics.scrapes else 0.0)
        rejected = CounterMetricFamily(
            "servegate_scaleout_rejected",
            "Well-formed bus state ignored: not for a pool member, too much of it, or not "
            "from a known origin (docs/reliability.md, threat model).",
            labels=["stream", "reason"],
        )
        for reason, n in s.inflight.rejected.items():
            rejected.add_metric(["inflight", reason], n)
        for reason, n in s.prefix.rejected.items():
            rejected.add_metric(["prefix", reason], n)
        rejected.add_metric(["metrics", "origin"], s.metrics.rejected)
        if s.link is not None:
            rejected.add_metric(["link", "curve_refused"], s.link.refused)
        return [peers, age, messages, invalid, released, scrapes, rejected]
