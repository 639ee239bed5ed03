import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from servegate.gateway import admission as admission_module
from servegate.gateway.admission import (
    QUEUE_DURATION_HEADER,
    GatewayAdmission,
    build_admission,
    queue_ms,
)
from servegate.gateway.errors import DROPPED_REASON_HEADER, GatewayError
from servegate.pool.pool import Pool
from servegate.scheduling.flowcontrol import FlowControlSettings
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import endpoint_state

SETTINGS = FlowControlSettings.model_validate(
    {
        "enabled": True,
        "default_request_ttl_s": 0.05,
        "saturation_detector": {
            "type": "concurrency-detector",
            "parameters": {"maxConcurrency": 1},
        },
        "objectives": [{"name": "critical", "priority": 10}, {"name": "batch", "priority": -1}],
    }
)


def setup(in_flight: int) -> tuple[Pool, GatewayAdmission, CollectorRegistry]:
    pool = Pool()
    state = pool.add(endpoint_state("a:1").endpoint)
    pool.set_health(state.address, True)
    state.in_flight_requests = in_flight
    registry = CollectorRegistry()
    return pool, build_admission(SETTINGS, pool, registry), registry


def request(headers: dict[str, str]) -> LLMRequest:
    return LLMRequest("r", RequestKind.CHAT, "m", "m", "m", headers=headers, fairness_id="t")


@pytest.mark.parametrize(
    ("headers", "priority"),
    [
        pytest.param({}, 0, id="none"),
        pytest.param({"x-llm-d-inference-objective": "critical"}, 10, id="new-header"),
        pytest.param({"x-gateway-inference-objective": "batch"}, -1, id="old-header"),
        pytest.param({"x-llm-d-inference-objective": "unknown"}, 0, id="unknown"),
    ],
)
def test_priority_from_objective(headers: dict[str, str], priority: int) -> None:
    _, admission, _ = setup(0)
    assert admission.priority_of(headers) == priority


@pytest.mark.parametrize(
    ("objective", "status", "reason"),
    [
        pytest.param("batch", 429, "rejected-saturated", id="sheddable"),
        pytest.param("critical", 429, "rejected-ttl-expired", id="ttl"),
    ],
)
async def test_drops_become_errors_with_headers(objective: str, status: int, reason: str) -> None:
    _, admission, registry = setup(1)
    with pytest.raises(GatewayError) as info:
        await admission.admit(request({"x-llm-d-inference-objective": objective}), 10)
    err = info.value
    assert (err.status, err.headers[DROPPED_REASON_HEADER]) == (status, reason)
    assert QUEUE_DURATION_HEADER in err.extra_headers
    text = generate_latest(registry).decode()
    assert "llm_d_epp_flow_control_request_queue_duration_seconds_count" in text
    outcome = "RejectedSaturated" if objective == "batch" else "EvictedTTL"
    assert (
        f'llm_d_epp_flow_control_requests_total{{inference_pool="default",outcome="{outcome}"'
        in text
    )


async def test_shutdown_turns_requests_away_as_shutting_down() -> None:
    """Draining: a queued request and a new one both get 503 `rejected-shutting-down`."""
    _, admission, _ = setup(1)
    queued = asyncio.create_task(admission.admit(request({}), 10))
    await asyncio.sleep(0)
    assert admission.close() == 1
    for attempt in (queued, asyncio.create_task(admission.admit(request({}), 10))):
        with pytest.raises(GatewayError) as info:
            await attempt
        assert info.value.status == 503
        assert info.value.headers[DROPPED_REASON_HEADER] == "rejected-shutting-down"
        assert info.value.canonical == "ServiceUnavailable"


async def test_dispatch_on_completion_and_metrics() -> None:
    pool, admission, registry = setup(1)
    task = asyncio.create_task(admission.admit(request({}), 10))
    await asyncio.sleep(0)
    text = generate_latest(registry).decode()
    held = (
        'fairness_id="t",inference_pool="default",model_name="m",priority="0",target_model_name="m"'
    )
    assert f"llm_d_epp_flow_control_queue_size{{{held}}} 1.0" in text
    assert f"llm_d_epp_flow_control_queue_bytes{{{held}}} 10.0" in text
    assert (
        'llm_d_epp_flow_control_pool_saturation{inference_pool="default",stage="effective"} 1.0'
        in text
    )
    enqueued = 'fairness_id="t",outcome="NotYetFinalized",priority="0"'
    assert (
        f"llm_d_epp_flow_control_request_enqueue_duration_seconds_count{{{enqueued}}} 1.0" in text
    )
    state = pool.get("a:1")
    assert state is not None
    state.in_flight_requests = 0
    admission.completed()
    assert await task >= 0.0
    text = generate_latest(registry).decode()
    assert 'outcome="Dispatched",priority="0"' in text
    assert f"llm_d_epp_flow_control_queue_size{{{held}}} 0.0" in text
    # the wake-up ran a dispatch cycle that released the request
    cycles = registry.get_sample_value(
        "llm_d_epp_flow_control_dispatch_cycle_duration_seconds_count"
    )
    assert cycles is not None and cycles >= 1.0


async def test_unqueued_request_is_timed_as_dispatched() -> None:
    _, admission, registry = setup(0)
    assert await admission.admit(request({}), 10) == 0.0
    labels = {"fairness_id": "t", "outcome": "Dispatched", "priority": "0"}
    name = "llm_d_epp_flow_control_request_enqueue_duration_seconds_count"
    assert registry.get_sample_value(name, labels) == 1.0


async def test_fairness_label_values_are_bounded() -> None:
    _, admission, registry = setup(0)
    admission.bound_fairness = type(admission.bound_fairness)(limit=2)
    for flow in ("a", "b", "c", "d"):
        req = LLMRequest("r", RequestKind.CHAT, "m", "m", "m", fairness_id=flow)
        await admission.admit(req, 1)
    text = generate_latest(registry).decode()
    assert 'fairness_id="b"' in text and 'fairness_id="other"' in text
    assert 'fairness_id="c"' not in text and 'fairness_id="d"' not in text


async def test_scrape_wakes_the_queue() -> None:
    pool, admission, _ = setup(1)
    task = asyncio.create_task(admission.admit(request({}), 10))
    await asyncio.sleep(0)
    state = pool.get("a:1")
    assert state is not None
    state.in_flight_requests = 0
    pool.set_metrics("a:1", state.metrics)  # what a scrape does
    assert await asyncio.wait_for(task, 1.0) >= 0.0


def flow_samples(
    registry: CollectorRegistry,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every flow-control sample but the timed ones' sums and creation times."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name.startswith("llm_d_epp_flow_control")
        and not s.name.endswith("_created")
        and not s.name.startswith("llm_d_epp_flow_control_request_enqueue_duration_seconds_sum")
    }


async def test_admit_now_counts_and_observes_what_admit_does() -> None:
    """The Director's path without a coroutine leaves the same series as the awaited one."""
    _, awaited, by_admit = setup(0)
    _, direct, by_admit_now = setup(0)
    assert await awaited.admit(request({}), 10) == 0.0
    assert direct.admit_now(request({}), 10, 0) is True
    assert direct.admit_now(request({}), 10, 0) is True
    assert await awaited.admit(request({}), 10) == 0.0
    samples = flow_samples(by_admit_now)
    assert samples == flow_samples(by_admit)
    dispatched = {"fairness_id": "t", "outcome": "Dispatched", "priority": "0"}
    enqueue_count = "llm_d_epp_flow_control_request_enqueue_duration_seconds_count"
    assert by_admit_now.get_sample_value(enqueue_count, dispatched) == 2.0
    queue = "llm_d_epp_flow_control_request_queue_duration_seconds"
    labels = {**dispatched, "model_name": "m", "target_model_name": "m"}
    assert by_admit_now.get_sample_value(f"{queue}_bucket", {**labels, "le": "0.0001"}) == 2.0
    assert by_admit_now.get_sample_value(f"{queue}_sum", labels) == 0.0


async def test_admit_now_leaves_a_request_on_a_saturated_pool_to_wait() -> None:
    pool, admission, registry = setup(1)
    req = request({})
    assert admission.admit_now(req, 10, 0) is False
    outcomes = "llm_d_epp_flow_control_requests_total"
    dispatched = {"inference_pool": "default", "outcome": "Dispatched", "priority": "0"}
    assert registry.get_sample_value(outcomes, dispatched) is None
    task = asyncio.create_task(admission.wait(req, 10))
    await asyncio.sleep(0)
    held = {
        "fairness_id": "t",
        "inference_pool": "default",
        "model_name": "m",
        "priority": "0",
        "target_model_name": "m",
    }
    assert registry.get_sample_value("llm_d_epp_flow_control_queue_size", held) == 1.0
    state = pool.get("a:1")
    assert state is not None
    state.in_flight_requests = 0
    admission.completed()
    assert await task >= 0.0
    assert registry.get_sample_value(outcomes, dispatched) == 1.0
    assert registry.get_sample_value("llm_d_epp_flow_control_queue_size", held) == 0.0


def test_admit_now_sheds_a_sheddable_request_on_a_saturated_pool() -> None:
    _, admission, registry = setup(1)
    with pytest.raises(GatewayError) as info:
        admission.admit_now(request({}), 10, -1)
    assert info.value.headers[DROPPED_REASON_HEADER] == "rejected-saturated"
    assert info.value.extra_headers[QUEUE_DURATION_HEADER] == "0"
    enqueued = {"fairness_id": "t", "outcome": "RejectedSaturated", "priority": "-1"}
    name = "llm_d_epp_flow_control_request_enqueue_duration_seconds_count"
    assert registry.get_sample_value(name, enqueued) == 1.0


def test_an_ejected_endpoint_takes_no_requests_until_its_ejection_is_lifted() -> None:
    """Flow control reads the pool's shared list of ready endpoints: an ejection (and its
    end) changes it at once."""
    pool, admission, _ = setup(0)
    assert admission.admit_now(request({}), 10, 0) is True
    pool.eject("a:1", time.monotonic() + 60.0)
    with pytest.raises(GatewayError) as info:
        admission.admit_now(request({}), 10, 0)
    assert info.value.headers[DROPPED_REASON_HEADER] == "rejected-no-endpoints"
    pool.eject("a:1", 0.0)
    assert admission.admit_now(request({}), 10, 0) is True


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        pytest.param(0.0, "0", id="at-once"),
        pytest.param(0.0004, "0", id="under-half-a-ms"),
        pytest.param(0.0015, "2", id="rounded"),
        pytest.param(2.5, "2500", id="seconds"),
    ],
)
def test_queue_duration_header_in_whole_milliseconds(seconds: float, header: str) -> None:
    assert queue_ms(seconds) == header


async def test_the_resolved_flows_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fairness ids come from clients: past `AT_ONCE_KEYS` the resolved children are
    dropped and resolved again, counting into the same series."""
    monkeypatch.setattr(admission_module, "AT_ONCE_KEYS", 2)
    _, admission, registry = setup(0)
    for flow in ("a", "b", "c", "a", "b", "c"):
        req = LLMRequest("r", RequestKind.CHAT, "m", "m", "m", fairness_id=flow)
        assert admission.admit_now(req, 1, 0) is True
        assert len(admission._at_once) <= 2
    name = "llm_d_epp_flow_control_request_enqueue_duration_seconds_count"
    for flow in ("a", "b", "c"):
        labels = {"fairness_id": flow, "outcome": "Dispatched", "priority": "0"}
        assert registry.get_sample_value(name, labels) == 2.0


def test_a_series_appears_with_its_first_observation() -> None:
    """A flow whose requests were only ever shed has no `Dispatched` series (the children
    of requests dispatched at once are resolved when the first one is)."""
    _, admission, registry = setup(1)
    for _ in range(2):
        with pytest.raises(GatewayError):
            admission.admit_now(request({}), 10, -1)
    text = generate_latest(registry).decode()
    assert 'outcome="RejectedSaturated",priority="-1"' in text
    assert 'outcome="Dispatched"' not in text
