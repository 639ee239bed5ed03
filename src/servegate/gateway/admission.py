"""The gateway's side of flow control: one HTTP request's wait, its headers and its metrics.

Priority comes from the objective a client names (`x-llm-d-inference-objective`,
or the older `x-gateway-inference-objective`) looked up in the configured
objectives; an unnamed or unknown objective is priority 0. The flow is the
fairness id (`x-llm-d-inference-fairness-id` / `x-gateway-inference-fairness-id`),
`default-flow` when absent. A client that disconnects while queued cancels its
handler; the request leaves the queue and is counted as
`EvictedContextCancelled`.

Metrics carry llm-d's labels (`fairness_id`, `priority`, `outcome`, `model_name`,
`target_model_name`; the runtime collector adds `inference_pool`). The fairness
id is client-chosen, so it is bounded as llm-d bounds it: after 1000 distinct
values, new ones are counted as `other`. Queue size and bytes are counted per
request while it is inside flow control, and read when /metrics is scraped.
"""

from __future__ import annotations

import asyncio
import random
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servegate.control.errors import (
    GatewayError,
    NoEndpoints,
    Saturated,
    ShuttingDown,
    TtlExpired,
)
from servegate.gateway.histogram import Buckets
from servegate.gateway.metrics import BoundedLabel, Family
from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.admitters import Admitter
from servegate.scheduling.config import parse_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.flowcontrol import (
    OBJECTIVE_HEADERS,
    FlowController,
    FlowControlSettings,
    Outcome,
    Rejected,
    SaturationDetector,
    detector_from_settings,
    from_picker_sections,
    queues_from_settings,
    resolve_detector,
)
from servegate.scheduling.flowcontrol.controller import DISPATCHED
from servegate.scheduling.flowcontrol.queues import DEFAULT_FLOW
from servegate.scheduling.framework import Plugin
from servegate.scheduling.request import LLMRequest

QUEUE_DURATION_HEADER = "x-llm-d-flow-queue-duration-ms"
MAX_FLOW_ID = 256
AT_ONCE_KEYS = 4096
"""(Fairness id, priority, model, target) keys whose children `admit_now` keeps resolved."""
FAST_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
QUEUE_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


def objective_of(headers: Mapping[str, str]) -> str | None:
    for name in OBJECTIVE_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None


class _FlowCollector(Collector):
    def __init__(self, admission: GatewayAdmission) -> None:
        self._admission = admission

    def collect(self) -> Iterable[Metric]:
        admission = self._admission
        controller = admission.controller
        pool_name = admission.pool.name
        labels = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]
        size = GaugeMetricFamily(
            "llm_d_epp_flow_control_queue_size",
            "Requests held in flow control.",
            labels=labels,
        )
        size_bytes = GaugeMetricFamily(
            "llm_d_epp_flow_control_queue_bytes",
            "Bytes of request bodies held in flow control.",
            labels=labels,
        )
        for (flow, priority, model, target), (count, held) in sorted(admission.held.items()):
            values = [flow, str(priority), pool_name, model, target]
            size.add_metric(values, count)
            size_bytes.add_metric(values, held)
        saturation = GaugeMetricFamily(
            "llm_d_epp_flow_control_pool_saturation",
            "Pool saturation from the saturation detector; 1.0 and above holds requests back.",
            labels=["inference_pool", "stage"],
        )
        saturation.add_metric([pool_name, "effective"], controller.saturation())
        outcomes = CounterMetricFamily(
            "llm_d_epp_flow_control_requests",
            "Requests that left flow control, by outcome and priority.",
            labels=["outcome", "priority", "inference_pool"],
        )
        for (priority, outcome), count in sorted(controller.stats.outcomes.items()):
            outcomes.add_metric([outcome.value, str(priority), pool_name], count)
        yield from (size, size_bytes, saturation, outcomes)


class GatewayAdmission:
    """Admits one request at a time through a `FlowController`; built once per gateway."""

    def __init__(
        self,
        controller: FlowController,
        pool: Pool,
        priorities: Mapping[str, int] | None = None,
        registry: CollectorRegistry | None = None,
        admitters: Sequence[Admitter] = (),
        rng: random.Random | None = None,
    ) -> None:
        self.controller = controller
        self.pool = pool
        self.priorities = dict(priorities or {})
        self.admitters = tuple(admitters)
        """llm-d admitter plugins (`probabilistic-admitter`), asked before flow control."""
        self._rng = rng or random.Random()
        # Observed once per request each: the lock-free `Family`, not prometheus_client's
        # locked children.
        self.queue_duration = Family(
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "Time requests spend in flow control, from arrival to their outcome.",
            "histogram",
            ["fairness_id", "priority", "outcome", "model_name", "target_model_name"],
            QUEUE_BUCKETS,
            registry,
        )
        self.enqueue_duration = Family(
            "llm_d_epp_flow_control_request_enqueue_duration_seconds",
            "Time to enqueue a request into flow control (or to dispatch it at once).",
            "histogram",
            ["fairness_id", "priority", "outcome"],
            FAST_BUCKETS,
            registry,
        )
        self.dispatch_cycle = Histogram(
            "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
            "Time of one dispatch cycle over the queues.",
            buckets=FAST_BUCKETS,
            registry=registry,
        )
        self.bound_fairness = BoundedLabel()
        self.held: dict[tuple[str, int, str, str], list[int]] = {}
        """(fairness id, priority, model, target) → [requests, bytes] inside flow control."""
        self._children: dict[tuple[str, int, Outcome, str, str], Buckets] = {}
        self._enqueue_children: dict[tuple[int, str, str], Buckets] = {}
        self._at_once: dict[tuple[str, int, str, str], tuple[str, Buckets, Buckets]] = {}
        """(fairness id, priority, model, target) → the flow's label, and the enqueue and
        queue-duration children of a request dispatched at once, resolved once."""
        controller.on_enqueue = self._observe_enqueue
        controller.on_dispatch = self.dispatch_cycle.observe
        if registry is not None:
            registry.register(_FlowCollector(self))

    def _observe(self, request: LLMRequest, flow: str, outcome: Outcome, seconds: float) -> None:
        self._child(request, flow, outcome).observe(seconds)

    def _child(self, request: LLMRequest, flow: str, outcome: Outcome) -> Buckets:
        key = (flow, request.priority, outcome, request.model, request.target_model)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.queue_duration.histogram(
                flow, str(request.priority), outcome.value, request.model, request.target_model
            )
        return child

    def _observe_enqueue(self, priority: int, flow: str, outcome: str, seconds: float) -> None:
        self._enqueue_child(priority, self.bound_fairness(flow), outcome).observe(seconds)

    def _enqueue_child(self, priority: int, label: str, outcome: str) -> Buckets:
        key = (priority, label, outcome)
        child = self._enqueue_children.get(key)
        if child is None:
            child = self.enqueue_duration.histogram(label, str(priority), outcome)
            self._enqueue_children[key] = child
        return child

    def priority_of(self, headers: Mapping[str, str]) -> int:
        name = objective_of(headers)
        return self.priorities.get(name, 0) if name is not None else 0

    async def admit(self, request: LLMRequest, size: int, max_priority: int | None = None) -> float:
        """Wait for dispatch; the seconds queued, or a `GatewayError` naming why it was dropped.
        `max_priority`: the highest the request may claim (its tenant's); higher is lowered."""
        priority = self.priority_of(request.headers)
        if max_priority is not None and priority > max_priority:
            priority = max_priority
        if self.admit_now(request, size, priority):
            return 0.0
        return await self.wait(request, size)

    def admit_now(self, request: LLMRequest, size: int, priority: int) -> bool:
        """`admit` without a coroutine, for the request that need not wait (nearly every
        one): True when it is dispatched at once, with the same counts and observations
        as `admit`; False when it must queue: then `await wait(request, size)`, with
        nothing awaited in between. `priority`: the request's, already capped by its
        tenant. Raises the `GatewayError` of a refusal."""
        started = perf_counter()
        request.priority = priority
        key = (request.fairness_id, priority, request.model, request.target_model)
        at_once = self._at_once.get(key)
        label = self._label(request) if at_once is None else at_once[0]
        if self.admitters:
            now = time.monotonic()
            available = [s for s in self.pool if self.pool.is_available(s, now)]
            for admitter in self.admitters:
                reason = admitter.refusal(priority, available, self._rng)
                if reason is not None:
                    self.controller.stats.count(priority, Outcome.REJECTED_SATURATED)
                    self._observe(request, label, Outcome.REJECTED_SATURATED, 0.0)
                    raise _as_error(Rejected(Outcome.REJECTED_SATURATED, reason), 0.0)
        try:
            dispatched = self.controller.gate(priority)
        except Rejected as rejected:
            outcome = rejected.outcome
            self._observe_enqueue(priority, label, outcome.value, perf_counter() - started)
            self._observe(request, label, outcome, 0.0)
            raise _as_error(rejected, 0.0) from rejected
        if dispatched:
            if at_once is None:
                at_once = self._at_once_children(key, request, label)
            _, enqueue, queue = at_once
            seconds = perf_counter() - started
            enqueue.counts[bisect_left(enqueue.bounds, seconds)] += 1
            enqueue.sum += seconds
            queue.counts[0] += 1  # waited 0.0 s: the first bucket, and nothing to the sum
        return dispatched

    def _label(self, request: LLMRequest) -> str:
        """The request's flow label; its queue gauges are shown from now on, as for every
        series that ever entered."""
        label = self.bound_fairness(request.fairness_id[:MAX_FLOW_ID] or DEFAULT_FLOW)
        self.held.setdefault((label, request.priority, request.model, request.target_model), [0, 0])
        return label

    def _at_once_children(
        self, key: tuple[str, int, str, str], request: LLMRequest, label: str
    ) -> tuple[str, Buckets, Buckets]:
        """The label and the enqueue and queue-duration children of a request dispatched
        at once, resolved when the first such request of `key` is (not before: a series
        appears with its first observation)."""
        at_once = (
            label,
            self._enqueue_child(request.priority, label, DISPATCHED),
            self._child(request, label, Outcome.DISPATCHED),
        )
        if len(self._at_once) >= AT_ONCE_KEYS:
            self._at_once.clear()  # fairness ids come from clients: stay bounded
        self._at_once[key] = at_once
        return at_once

    async def wait(self, request: LLMRequest, size: int) -> float:
        """Queue the request `admit_now` did not dispatch; the seconds it waited."""
        priority = request.priority
        flow = request.fairness_id[:MAX_FLOW_ID]
        label = self.bound_fairness(flow or DEFAULT_FLOW)
        tokens = request.prompt_tokens + (request.max_tokens or 0)
        held = self.held.setdefault((label, priority, request.model, request.target_model), [0, 0])
        held[0] += 1
        held[1] += size
        started = time.monotonic()
        try:
            admission = await self.controller.wait(priority, flow, size, tokens)
        except Rejected as rejected:
            waited = time.monotonic() - started
            self._observe(request, label, rejected.outcome, waited)
            raise _as_error(rejected, waited) from rejected
        except asyncio.CancelledError:
            self._observe(
                request, label, Outcome.EVICTED_CONTEXT_CANCELLED, time.monotonic() - started
            )
            raise
        finally:
            held[0] -= 1
            held[1] -= size
        self._observe(request, label, Outcome.DISPATCHED, admission.waited_s)
        return admission.waited_s

    def completed(self) -> None:
        """A request finished (any outcome after dispatch): capacity may have freed."""
        self.controller.notify()

    def close(self) -> int:
        return self.controller.close()


def _as_error(rejected: Rejected, waited: float) -> GatewayError:
    outcome = rejected.outcome
    error: GatewayError
    if outcome is Outcome.EVICTED_TTL:
        error = TtlExpired(rejected.message)
    elif outcome is Outcome.EVICTED_SHUTDOWN:
        error = ShuttingDown(rejected.message)
    elif outcome in (Outcome.REJECTED_CAPACITY, Outcome.REJECTED_SATURATED):
        error = Saturated(rejected.message)
    else:
        error = NoEndpoints(rejected.message)
    error.extra_headers = {QUEUE_DURATION_HEADER: queue_ms(waited)}
    return error


def queue_ms(seconds: float) -> str:
    if not seconds:
        return "0"  # every request flow control dispatched at once
    return str(round(seconds * 1000.0))


def build_admission(
    settings: FlowControlSettings,
    pool: Pool,
    registry: CollectorRegistry | None,
    picker_doc: Mapping[str, Any] | str | None = None,
    plugins: Mapping[str, Plugin] | None = None,
    ctx: PluginContext | None = None,
) -> GatewayAdmission:
    """Flow control over `pool`'s available endpoints, woken whenever the pool's state is written.

    llm-d's sections in the picker document (`featureGates`, `flowControl`,
    `saturationDetector`) are applied over `settings`; a detector they name by
    `pluginRef` is the plugin instance the picker config declared.
    """
    detector: SaturationDetector | None = None
    if picker_doc is not None:
        doc = parse_picker_config(picker_doc)
        settings, plugin_ref = from_picker_sections(
            settings, doc.feature_gates, doc.flow_control, doc.saturation_detector
        )
        if plugin_ref:
            detector = resolve_detector(plugin_ref, plugins or {})

    def available(now: float) -> list[EndpointState]:
        # the pool's shared list of every ready endpoint (the same set as
        # `is_available`, rebuilt only when membership, health, drain or ejection change)
        return pool.candidates(None, now)

    controller = FlowController(
        detector or detector_from_settings(settings, ctx),
        available,
        queues_from_settings(settings),
        enabled=settings.enabled,
        ttl_s=settings.default_request_ttl_s,
        band_ttl_s=settings.band_ttls(),
    )
    pool.watch_state(lambda _state: controller.notify())
    admitters = [p for p in (plugins or {}).values() if isinstance(p, Admitter)]
    return GatewayAdmission(controller, pool, settings.priorities(), registry, admitters)
