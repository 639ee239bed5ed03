import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from servegate.gateway.admission import QUEUE_DURATION_HEADER, GatewayAdmission, build_admission
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
    assert "inference_extension_flow_control_request_queue_duration_seconds_count" in text


async def test_dispatch_on_completion_and_metrics() -> None:
    pool, admission, registry = setup(1)
    task = asyncio.create_task(admission.admit(request({}), 10))
    await asyncio.sleep(0)
    text = generate_latest(registry).decode()
    assert (
        'inference_extension_flow_control_queue_size{inference_pool="default",priority="0"} 1.0'
        in text
    )
    assert 'inference_extension_flow_control_pool_saturation{inference_pool="default"} 1.0' in text
    state = pool.get("a:1")
    assert state is not None
    state.in_flight_requests = 0
    admission.completed()
    assert await task >= 0.0
    text = generate_latest(registry).decode()
    assert 'outcome="Dispatched",priority="0"' in text


async def test_scrape_wakes_the_queue() -> None:
    pool, admission, _ = setup(1)
    task = asyncio.create_task(admission.admit(request({}), 10))
    await asyncio.sleep(0)
    state = pool.get("a:1")
    assert state is not None
    state.in_flight_requests = 0
    pool.set_metrics("a:1", state.metrics)  # what a scrape does
    assert await asyncio.wait_for(task, 1.0) >= 0.0
