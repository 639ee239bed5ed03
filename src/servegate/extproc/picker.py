"""One routing decision for the ext_proc data plane, made exactly as the HTTP gateway makes it.

The steps and their order are the HTTP gateway's (`gateway/app.py`): resolve the
model, wait in flow control, take the pool's candidates, prepare cache routing,
run the scheduler with the gateway's clock and random generator, tell the
`PreRequest` plugins. The same `Gateway` (from `build_gateway`) and the same
state give the same decision in both modes. What ext_proc adds: the proxy's
subset hint narrows the candidates, and there is no forwarding here (Envoy does it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from servegate.gateway.app import Gateway
from servegate.gateway.errors import ModelNotFound, NoEndpoints
from servegate.gateway.headers import model_rewrite_of, within_subset
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.framework import CycleState, Decision, NoCandidates
from servegate.scheduling.request import LLMRequest


@dataclass(frozen=True, slots=True)
class Routed:
    decision: Decision
    targets: tuple[EndpointState, ...]
    """Primary first, then fallbacks: at most `gateway.max_retries + 1`, as in HTTP mode."""

    @property
    def destinations(self) -> str:
        """The `x-gateway-destination-endpoint` value: `ip:port[,ip:port…]`."""
        return ",".join(s.address for s in self.targets)


def resolve_model(gw: Gateway, llm: LLMRequest) -> None:
    """The pool's model or adapter; llm-d's model-name-rewrite header names another."""
    named = model_rewrite_of(llm.headers) or llm.model
    if not named:
        return  # a passthrough body without a model: any endpoint of the pool
    entry = gw.pool.resolve_model(named)
    if entry is None:
        if named != llm.model:
            raise ModelNotFound(
                f"The model `{llm.model}` is routed to `{named}`, which no pool serves."
            )
        raise ModelNotFound(f"The model `{llm.model}` does not exist.")
    llm.target_model = entry.id
    llm.base_model = entry.base
    llm.lora = entry.id if entry.parent else None


async def admit(gw: Gateway, llm: LLMRequest, size: int, max_priority: int | None = None) -> float:
    """Flow control's wait (the HTTP gateway's `GatewayAdmission`); 0 when none is built."""
    if gw.admission is None:
        return 0.0
    return await gw.admission.admit(llm, size, max_priority)


async def pick(gw: Gateway, llm: LLMRequest, subset: Sequence[str] | None) -> Routed:
    """Schedule an admitted request; raises `NoEndpoints` (503) when nothing fits.

    The caller has already waited in `admit` and owns the matching `completed()`.
    """
    now = time.monotonic()
    candidates = gw.pool.candidates(llm.base_model or None, now, llm.lora)
    if subset is not None:
        candidates = within_subset(candidates, subset)
        if not candidates:
            raise NoEndpoints(
                f"no ready endpoint serves model `{llm.model}` within the proxy's subset hint"
            )
    if not candidates:
        raise NoEndpoints(f"no ready endpoint serves model `{llm.model}`")
    await gw.cache_routing.prepare(llm, candidates)
    t0 = time.perf_counter()
    try:
        decision = gw.scheduler.schedule(llm, candidates, CycleState(now=now, rng=gw.rng))
    except NoCandidates as exc:
        gw.metrics.scheduled(llm.target_model, None)
        raise NoEndpoints(f"no endpoint fits the request for model `{llm.model}`") from exc
    gw.metrics.decision.observe(time.perf_counter() - t0)
    gw.metrics.observe_pick(gw.pool.name, decision)
    gw.metrics.scheduled(llm.target_model, decision.endpoint.address)
    gw.scheduler.pre_request(llm, decision, now)
    targets = tuple(decision.targets[: gw.config.gateway.max_retries + 1])
    return Routed(decision=decision, targets=targets)


def pick_any(gw: Gateway, subset: Sequence[str] | None) -> EndpointState:
    """A request without a body (`GET /v1/models`): any available endpoint, by the gateway's rng."""
    now = time.monotonic()
    candidates = gw.pool.candidates(None, now)
    if subset is not None:
        candidates = within_subset(candidates, subset)
    if not candidates:
        raise NoEndpoints("no ready endpoint in the pool")
    return candidates[gw.rng.randrange(len(candidates))]
