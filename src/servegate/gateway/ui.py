"""The gateway's built-in status page: read-only, one HTML file, no external assets.

    GET /ui               the page (ui.html, package data); it polls:
    GET /ui/state.json    every pool's endpoints with their live signals, routing share,
                          the cluster prefix-cache hit rate from the engines' counters,
                          flow-control queues, and the latest scheduling decisions with
                          their per-scorer scores

Cheap for the hot path: the request path only appends a reference to each decision to
a bounded ring (`DecisionLog.record`, one `deque.append`); everything else is read from
state the gateway keeps anyway, and computed only when someone asks for the page.

When `gateway.admin_keys` is set, both routes want one of them, as a bearer token or as
the password of HTTP basic auth (any user name) so a browser can ask for it itself;
without admin keys the page is open, read-only, like `/metrics`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from collections import deque
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from servegate.gateway.admin import runtime_state
from servegate.gateway.errors import Unauthorized, render
from servegate.scheduling.scheduler import result_as_dict

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway
    from servegate.gateway.pools import PoolRuntime
    from servegate.scheduling.framework import Decision
    from servegate.scheduling.request import LLMRequest

DECISIONS_KEPT = 64
DECISIONS_SHOWN = 25
REALM_HEADER = {"WWW-Authenticate": 'Basic realm="servegate"'}

_Entry = tuple[int, float, str, str, str, int, "Decision"]


class DecisionLog:
    """The latest `size` scheduling decisions, by reference; rendered only on request.

    A `Decision`'s score tables are lazy views over the scorers' output columns, which
    the scorers allocate per cycle, so keeping the reference keeps the scores as they
    were when the request was routed.
    """

    __slots__ = ("_ring", "recorded")

    def __init__(self, size: int = DECISIONS_KEPT) -> None:
        self._ring: deque[_Entry] = deque(maxlen=size)
        self.recorded = 0

    def record(self, pool: str, request: LLMRequest, decision: Decision, now: float) -> None:
        self.recorded += 1
        self._ring.append(
            (
                self.recorded,
                now,
                pool,
                request.model,
                request.target_model,
                request.prompt_tokens,
                decision,
            )
        )

    def __len__(self) -> int:
        return len(self._ring)

    def latest(self, limit: int, now: float) -> list[dict[str, Any]]:
        """The newest `limit` decisions, newest first, as JSON-ready records."""
        out: list[dict[str, Any]] = []
        for seq, at, pool, model, target, tokens, decision in reversed(self._ring):
            if len(out) >= limit:
                break
            record = decision_record(at, pool, model, target, tokens, decision, now)
            record["seq"] = seq
            out.append(record)
        return out


def decision_record(
    at: float, pool: str, model: str, target: str, tokens: int, decision: Decision, now: float
) -> dict[str, Any]:
    result = decision.results.get(decision.profile)
    detail = result_as_dict(result) if result is not None else None
    return {
        "age_s": round(max(0.0, now - at), 3),
        "pool": pool,
        "model": model,
        "target_model": target,
        "prompt_tokens": tokens,
        "profile": decision.profile,
        "endpoint": decision.endpoint.address,
        "prefill": decision.prefill.address if decision.prefill is not None else None,
        "fallbacks": [s.address for s in decision.fallbacks],
        "ranked": detail["ranked"] if detail else [],
        "totals": detail["totals"] if detail else {},
        "scores": detail["scores"] if detail else {},
    }


def _pool_record(runtime: PoolRuntime, now: float) -> dict[str, Any]:
    record = runtime_state(runtime, now)
    by_address = {s.address: s for s in runtime.pool}
    total_picks = sum(s.picks for s in by_address.values())
    hits = queries = 0.0
    reporting = 0
    for endpoint in record["endpoints"]:
        state = by_address[endpoint["address"]]
        m = state.metrics
        lora = m.lora
        endpoint["lora"] = (
            None
            if lora is None
            else {
                "max": lora.max_lora,
                "running": sorted(lora.running),
                "waiting": sorted(lora.waiting),
            }
        )
        endpoint["prefix_cache"] = {"hits": m.prefix_cache_hits, "queries": m.prefix_cache_queries}
        endpoint["share"] = state.picks / total_picks if total_picks else None
        endpoint["served_models"] = sorted(state.served_models)
        if m.prefix_cache_hits is not None and m.prefix_cache_queries is not None:
            hits += m.prefix_cache_hits
            queries += m.prefix_cache_queries
            reporting += 1
    record["picks"] = total_picks
    record["prefix_cache"] = {
        "hits": hits,
        "queries": queries,
        "hit_rate": hits / queries if queries > 0 else None,
        "endpoints_reporting": reporting,
    }
    record["scheduler"] = {
        "cycles": runtime.scheduler.stats.cycles,
        "no_candidates": runtime.scheduler.stats.no_candidates,
    }
    return record


def ui_state(gw: Gateway, now: float | None = None) -> dict[str, Any]:
    """What `/ui/state.json` answers; reads the gateway's state, changes nothing."""
    t = time.monotonic() if now is None else now
    pools = [_pool_record(r, t) for r in gw.runtimes]
    hits = sum(p["prefix_cache"]["hits"] for p in pools)
    queries = sum(p["prefix_cache"]["queries"] for p in pools)
    return {
        "uptime_s": round(time.time() - gw.started_at, 1),
        "pools": pools,
        "cluster": {
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "hit_rate": hits / queries if queries > 0 else None,
            "endpoints": sum(len(p["endpoints"]) for p in pools),
            "ready_endpoints": sum(p["ready_endpoints"] for p in pools),
        },
        "decisions_recorded": gw.decisions.recorded,
        "decisions": gw.decisions.latest(DECISIONS_SHOWN, t),
    }


def _supplied_token(header: str) -> bytes:
    scheme, _, value = header.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip().encode()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]
    return b""


def check_ui_key(keys: tuple[str, ...], header: str) -> None:
    """Passes when no admin key is configured, or one matches (bearer or basic password)."""
    if not keys:
        return
    supplied = _supplied_token(header)
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(supplied, key.encode())
    if not ok:
        raise Unauthorized(
            "the status page needs an admin key: 'Authorization: Bearer <admin key>' "
            "or basic auth with the key as password"
        )


def _page() -> bytes:
    return resources.files("servegate.gateway").joinpath("ui.html").read_bytes()


def add_ui_routes(app: web.Application, gateway_key: web.AppKey[Gateway]) -> None:
    page = _page()

    def _allowed(request: web.Request) -> web.Response | None:
        gw = request.app[gateway_key]
        try:
            check_ui_key(gw.config.gateway.admin_keys, request.headers.get("Authorization", ""))
        except Unauthorized as exc:
            return render(exc, REALM_HEADER)
        return None

    async def get_page(request: web.Request) -> web.Response:
        denied = _allowed(request)
        if denied is not None:
            return denied
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Cache-Control": "no-store",
                "Content-Security-Policy": (
                    "default-src 'none'; script-src 'unsafe-inline'; "
                    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:"
                ),
            },
        )

    async def get_state(request: web.Request) -> web.Response:
        denied = _allowed(request)
        if denied is not None:
            return denied
        body = orjson.dumps(ui_state(request.app[gateway_key]))
        return web.Response(
            body=body, content_type="application/json", headers={"Cache-Control": "no-store"}
        )

    app.router.add_get("/ui", get_page)
    app.router.add_get("/ui/state.json", get_state)
