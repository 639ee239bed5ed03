"""The request path, once for every data plane.

    rewrite the model → its pool → tenant and priority → flow control →
    candidates (narrowed by the proxy's subset) → routing tokenisation →
    SLO admission → schedule() → lease → [the data plane forwards] →
    complete → finish (tenant settle, latency learning, metrics, access log)

An adapter (`gateway/app.py` for HTTP, `extproc/stream.py` for Envoy) reads its wire,
calls `begin`, `authorise`, `route`, lets its data plane carry the request where
`ctx.decision` says, then calls `complete` on success, `fail` with a `GatewayError`, and
`finish` exactly once, however the request ended.

No await separates `schedule()` from the lease's endpoint count: routing tokenisation may
await (`/tokenize`) so it runs before flow control, and a burst cannot pass flow control
before any of it counts as in flight.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import orjson

from servegate.control.context import NO_HEADERS, RequestContext
from servegate.control.errors import GatewayError, ModelNotFound, NoEndpoints, clip
from servegate.control.lease import Lease
from servegate.gateway.access_log import AccessRecord
from servegate.gateway.admission import QUEUE_DURATION_HEADER, queue_ms
from servegate.gateway.headers import SUBSET_HEADER, model_rewrite_of, within_subset
from servegate.gateway.parse import parse_request, strip_gateway_fields, with_model
from servegate.scheduling.framework import CycleState, NoCandidates
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import result_as_dict

if TYPE_CHECKING:
    from servegate.control.snapshot import RoutingSnapshot
    from servegate.gateway.access_log import AccessLog
    from servegate.gateway.metrics import GatewayMetrics
    from servegate.gateway.pools import PoolRuntime
    from servegate.gateway.ui import DecisionLog
    from servegate.scheduling.framework import Decision

Parser = Callable[[bytes, RequestKind, Mapping[str, str], str], LLMRequest]

SERVED_MODEL_HEADER = "x-servegate-served-model"
"""On responses whose model was rewritten: the model the replica was asked for."""
SCORES_HEADER = "x-servegate-scores"
"""With `gateway.debug_headers`: the chosen profile's scores per endpoint and scorer."""
DISAGG_KINDS = frozenset({RequestKind.CHAT, RequestKind.COMPLETION})
"""Kinds a prefill/decode split applies to; others go to the decode target as they are."""


class Director:
    """Runs every request's routing steps against the current `RoutingSnapshot`.

    `snapshot` is the one reference a reload swaps; the metrics, access log, random
    generator and decision log live as long as the process.
    """

    __slots__ = ("access_log", "decisions", "metrics", "rng", "snapshot")

    def __init__(
        self,
        snapshot: RoutingSnapshot,
        metrics: GatewayMetrics,
        access_log: AccessLog,
        rng: random.Random,
        decisions: DecisionLog,
    ) -> None:
        self.snapshot = snapshot
        self.metrics = metrics
        self.access_log = access_log
        self.rng = rng
        self.decisions = decisions

    def begin(
        self, request_id: str, method: str, path: str, headers: Mapping[str, str], started: float
    ) -> RequestContext:
        """A request arrived: its context, on the snapshot current now."""
        record = AccessRecord.arrived(request_id, method, path)
        return RequestContext(self.snapshot, request_id, record, started, headers, NO_HEADERS)

    @staticmethod
    def authorise(ctx: RequestContext) -> None:
        """The tenant whose key the request carries (None when keys are off); raises 401."""
        ctx.tenant = ctx.snapshot.tenants.authenticate(ctx.headers.get("authorization", ""))

    async def route(
        self,
        ctx: RequestContext,
        body: bytes,
        kind: RequestKind,
        subset: Sequence[str] | None,
        parse: Parser = parse_request,
    ) -> tuple[PoolRuntime, Decision]:
        """Parse, admit and schedule: returns the pool's runtime and the decision; then
        `ctx.lease` holds the pick's in-flight count, and `ctx.body` and the headers both
        ways are set. Raises a `GatewayError` for the client."""
        ctx.request_bytes = len(body)
        llm = parse(body, kind, ctx.headers, ctx.request_id)
        if strip_gateway_fields(llm.body):
            body = orjson.dumps(llm.body)
        ctx.llm = llm
        record = ctx.record
        record.model = llm.model
        tenant = ctx.tenant
        ctx.estimated = llm.prompt_tokens + (llm.max_tokens or 0)
        max_priority: int | None = None
        if tenant is not None:
            record.tenant = tenant.name
            llm.fairness_id = tenant.fairness_id
            tenant.admit(ctx.estimated)
            max_priority = tenant.max_priority
        rt = ctx.runtime = self.select_pool(ctx.snapshot, llm)
        lease = ctx.lease = Lease(rt)
        record.target_model = llm.target_model
        record.pool = rt.name
        llm.priority = rt.admission.priority_of(ctx.headers)
        if max_priority is not None and llm.priority > max_priority:
            llm.priority = max_priority
        metrics = self.metrics
        ctx.series = metrics.start(llm.model, llm.target_model, llm.fairness_id, llm.priority)
        pool = rt.state.pool
        now = time.monotonic()
        early = pool.candidates(llm.base_model, now, llm.lora)
        cache_routing = rt.cache_routing
        awaited = False
        if early and cache_routing.needs_prepare(llm):
            await cache_routing.prepare(llm, early)
            awaited = True
        admission = rt.admission
        if not admission.admit_now(llm, len(body), llm.priority):
            ctx.queued_s = await admission.wait(llm, len(body))
            awaited = True
        lease.admit()
        if awaited or not early:
            # the pool may have changed while this request waited (or, for a body without
            # a model, `early` asked for the wrong base): read its candidates again
            now = time.monotonic()
            candidates = pool.candidates(llm.base_model or None, now, llm.lora)
        else:
            candidates = early
        if subset is not None:
            candidates = within_subset(candidates, subset)
            if not candidates:
                raise NoEndpoints(
                    f"no ready endpoint serves model `{llm.target_model}` within {SUBSET_HEADER}"
                )
        if not candidates:
            raise NoEndpoints(f"no ready endpoint serves model `{llm.target_model}`")
        if not early and cache_routing.needs_prepare(llm):
            await cache_routing.prepare(llm, candidates)
        latency = rt.latency
        fresh = await latency.admit(llm, ctx.started, candidates, pool, self.rng)
        if fresh is not None:
            now, candidates = time.monotonic(), fresh
            if not candidates:
                raise NoEndpoints(f"no ready endpoint serves model `{llm.target_model}`")
        t0 = time.perf_counter()
        cycle = CycleState(now=now, rng=self.rng)
        try:
            decision = rt.scheduler.schedule(llm, candidates, cycle)
        except NoCandidates as exc:
            metrics.scheduled(llm.target_model, None)
            raise NoEndpoints(
                f"no endpoint fits the request for model `{llm.target_model}`"
            ) from exc
        lease.bind(decision.endpoint, ctx.tokens, now)
        ctx.decision = decision
        metrics.decision.observe(time.perf_counter() - t0)
        metrics.observe_pick(rt.name, decision)
        metrics.scheduled(llm.target_model, decision.endpoint.address)
        ctx.ticket = ticket = latency.dispatch(llm, decision, record, cycle, ctx.started)
        rt.scheduler.pre_request(llm, decision, now)
        self.decisions.record(rt.name, llm, decision, now)
        if decision.pd_decision is not None and kind in DISAGG_KINDS:
            record.pd_decision = decision.pd_decision
            metrics.pd_decision(llm.target_model, decision.pd_decision)
        extra = ctx.response_headers
        extra["X-Request-ID"] = ctx.request_id
        extra[QUEUE_DURATION_HEADER] = queue_ms(ctx.queued_s)
        cache_routing.headers(llm, decision, extra)
        if ctx.snapshot.config.gateway.debug_headers:
            result = decision.results.get(decision.profile)
            if result is not None:
                extra[SCORES_HEADER] = orjson.dumps(result_as_dict(result)).decode()
            ticket.debug(extra)
        ctx.upstream_headers = decision.upstream_headers
        if llm.target_model != llm.model:
            body = with_model(llm, body)
            extra[SERVED_MODEL_HEADER] = llm.target_model
        ctx.body = body
        return rt, decision

    def select_pool(self, snapshot: RoutingSnapshot, llm: LLMRequest) -> PoolRuntime:
        """Rewrite the model (aliases, weighted splits, llm-d's model-name-rewrite header),
        then find the pool that serves it. A rule for the requested model wins over the
        header."""
        runtimes = snapshot.runtimes
        if not llm.model:
            # a passthrough body without a model (vLLM's default): the default pool, any endpoint
            return runtimes[0]
        routing = snapshot.routing
        model = llm.model
        if routing.fallback is None and model not in routing.splits:
            # no rule names the model (the common case): no draw, nothing rewritten
            target, pool_name, rewritten = model, None, False
        else:
            served = routing.fallback is not None and any(
                r.state.pool.resolve_model(model) is not None for r in runtimes
            )
            routed = routing.route(model, llm.headers, self.rng, served)
            target, pool_name, rewritten = routed.model, routed.pool, routed.rewritten
            if rewritten:
                self.metrics.rewritten(routed.rule, model, target)
        if not rewritten:
            named = model_rewrite_of(llm.headers)
            if named is not None and named != model:
                target, pool_name, rewritten = named, None, True
        for runtime in runtimes:
            if pool_name is not None and runtime.name != pool_name:
                continue
            entry = runtime.state.pool.resolve_model(target)
            if entry is not None:
                llm.target_model = entry.id
                llm.base_model = entry.base
                llm.lora = entry.id if entry.parent else None
                return runtime
        if rewritten:
            raise ModelNotFound(
                f"The model `{clip(model)}` is routed to `{clip(target)}`, which no pool serves."
            )
        raise ModelNotFound(f"The model `{clip(model)}` does not exist.")

    @staticmethod
    def complete(ctx: RequestContext) -> None:
        """The response ended well: the scheduler's `ResponseComplete` plugins learn it,
        with the endpoint that served (a fallback, when the primary failed)."""
        lease, llm = ctx.lease, ctx.llm
        if lease is not None and lease.state is not None and llm is not None:
            lease.runtime.scheduler.response_complete(llm, lease.state, time.monotonic())

    def fail(self, ctx: RequestContext, exc: GatewayError) -> None:
        """The request ends with `exc` for the client (the adapter renders it)."""
        record = ctx.record
        record.status = exc.status
        record.error = exc.message
        ctx.error_code = exc.canonical
        if ctx.series is None:
            self.metrics.error(exc.canonical, model=record.model or "")

    def finish(self, ctx: RequestContext) -> None:
        """Account for the request once: tenant tokens, latency learning, the lease, metrics
        and the access log. A request that got no status never got an answer: 499."""
        record = ctx.record
        lease = ctx.lease
        tenant = ctx.tenant
        if (
            tenant is not None
            and lease is not None
            and lease.admitted
            and record.completion_tokens is not None
        ):
            tenant.settle(ctx.estimated, (record.prompt_tokens or 0) + record.completion_tokens)
        now = time.monotonic()
        if ctx.ticket is not None:
            ctx.ticket.done(record, now)
        if lease is not None:
            lease.release()
        elapsed = now - ctx.started
        record.latency_ms = elapsed * 1000.0
        if record.status == 0:
            record.status = 499
            record.error = record.error or "client disconnected"
        metrics = self.metrics
        if ctx.series is not None:
            metrics.finish(ctx.series, record, elapsed, ctx.request_bytes, ctx.error_code)
        metrics.response(record.status).inc()
        self.access_log.write(record)
