"""Operator routes: the pool's state, and draining an endpoint, behind their own key.

    GET  /admin/pool                          the default pool: endpoints, passive health,
                                              flow control, routing signals
    GET  /admin/pools                         every pool, and the model rewrites
    POST /admin/endpoints/{address}/drain     take no new requests, finish what it has
    POST /admin/endpoints/{address}/undrain
    POST /admin/reload                        re-read the config file (as SIGHUP does)

Admin keys (`gateway.admin_keys`) are separate from the API keys clients use,
compared in constant time; with none configured every admin call answers 403.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from servegate.gateway.errors import Forbidden, GatewayError, NotFound, Unauthorized, render

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway
    from servegate.gateway.pools import PoolRuntime
    from servegate.gateway.reload import Reloader

ADMIN_PREFIX = "/admin/"


def check_admin_key(keys: tuple[str, ...], header: str) -> None:
    if not keys:
        raise Forbidden("the admin API is disabled; set gateway.admin_keys to enable it")
    scheme, _, token = header.partition(" ")
    supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(supplied, key.encode())
    if not ok:
        raise Unauthorized("invalid or missing admin key; send 'Authorization: Bearer <admin key>'")


def pool_state(gw: Gateway, now: float | None = None) -> dict[str, Any]:
    """What an operator needs to see: every endpoint's live state, passive health, flow control."""
    return runtime_state(gw.default, now)


def pools_state(gw: Gateway, now: float | None = None) -> dict[str, Any]:
    return {
        "pools": [runtime_state(r, now) for r in gw.runtimes],
        "model_rewrites": {
            name: {
                "pool": split.pool,
                "sticky_header": split.sticky_header,
                "targets": {t.model: t.weight for t in split.targets},
            }
            for name, split in sorted(gw.routing.splits.items())
        },
    }


def runtime_state(runtime: PoolRuntime, now: float | None = None) -> dict[str, Any]:
    t = time.monotonic() if now is None else now
    pool = runtime.pool
    outlier = runtime.state.outlier
    endpoints = []
    for s in pool:
        m = s.metrics
        record = outlier.records.get(s.address) if outlier is not None else None
        endpoints.append(
            {
                "address": s.address,
                "url": s.endpoint.url,
                "engine": s.endpoint.engine,
                "role": s.endpoint.role.value,
                "model": s.endpoint.model,
                "available": pool.is_available(s, t),
                "healthy": s.healthy,
                "draining": s.draining,
                "ejected_for_s": round(max(0.0, s.ejected_until - t), 3),
                "in_flight_requests": s.in_flight_requests,
                "in_flight_tokens": s.in_flight_tokens,
                "picks": s.picks,
                "metrics": {
                    "waiting": m.waiting,
                    "running": m.running,
                    "kv_usage": m.kv_usage,
                    "age_s": round(t - m.scraped_at, 3) if m.scraped_at else None,
                },
                "passive_health": None
                if record is None
                else {
                    "consecutive_failures": record.consecutive_failures,
                    "ejections": record.ejected_total,
                    "refused_ejections": record.refused_total,
                    "failures": dict(record.failures),
                },
            }
        )
    out: dict[str, Any] = {
        "pool": pool.name,
        "ready_endpoints": pool.ready_count(t),
        "endpoints": endpoints,
    }
    signals = runtime.cache_routing.signals
    if signals is not None:
        out["routing_signals"] = signals.signals()
    admission = runtime.admission
    if admission is not None:
        controller = admission.controller
        out["flow_control"] = {
            "enabled": controller.enabled,
            "saturation": controller.saturation(t),
            "queued": controller.queues.requests,
            "queued_bytes": controller.queues.bytes,
            "queued_by_priority": {str(k): v for k, v in controller.queued_by_priority().items()},
            "outcomes": {
                f"{priority}/{outcome.value}": n
                for (priority, outcome), n in sorted(controller.stats.outcomes.items())
            },
        }
    return out


def set_draining(gw: Gateway, address: str, draining: bool) -> dict[str, Any]:
    """Drain (or undrain) `address` in every pool that has it; raises `NotFound`."""
    owners = [r for r in gw.runtimes if r.pool.set_draining(address, draining)]
    if not owners:
        raise NotFound(f"no endpoint {address!r} in any pool")
    for runtime in owners:
        runtime.admission.completed()
    return {"address": address, "draining": draining}


async def reload_config(reloader: Reloader) -> tuple[int, dict[str, Any]]:
    """Reload the gateway's config file: the status and body of the answer."""
    result = await reloader.reload()
    body = {"ok": result.ok, "error": result.error, "pools": list(result.pools)}
    return result.status, body


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


Handler = Callable[[web.Request], Awaitable[web.Response]]


def add_admin_routes(
    app: web.Application, gateway_key: web.AppKey[Gateway], reloader_key: web.AppKey[Reloader]
) -> None:
    def _gw(request: web.Request) -> Gateway:
        gw = request.app[gateway_key]
        check_admin_key(gw.config.gateway.admin_keys, request.headers.get("Authorization", ""))
        return gw

    async def get_pool(request: web.Request) -> web.Response:
        try:
            return _json(pool_state(_gw(request)))
        except GatewayError as exc:
            return render(exc)

    def _set_draining(draining: bool) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            try:
                return _json(set_draining(_gw(request), request.match_info["address"], draining))
            except GatewayError as exc:
                return render(exc)

        return handler

    async def get_pools(request: web.Request) -> web.Response:
        try:
            return _json(pools_state(_gw(request)))
        except GatewayError as exc:
            return render(exc)

    async def reload(request: web.Request) -> web.Response:
        try:
            _gw(request)
        except GatewayError as exc:
            return render(exc)
        status, body = await reload_config(request.app[reloader_key])
        return _json(body, status)

    app.router.add_get("/admin/pool", get_pool)
    app.router.add_get("/admin/pools", get_pools)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/endpoints/{address}/drain", _set_draining(True))
    app.router.add_post("/admin/endpoints/{address}/undrain", _set_draining(False))
