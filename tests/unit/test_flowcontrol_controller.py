import asyncio
import time

import pytest

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.flowcontrol import (
    BandLimits,
    ConcurrencyDetector,
    ConcurrencyParameters,
    FlowController,
    FlowQueues,
    Outcome,
    Rejected,
    UtilizationDetector,
    UtilizationParameters,
)
from servegate.testing.endpoints import endpoint_state


def controller(
    in_flight: int, capacity: int = 2, *, enabled: bool = True, ttl_s: float = 5.0, **queues: object
) -> tuple[FlowController, EndpointState]:
    state = endpoint_state("a:1", in_flight_requests=in_flight)
    detector = ConcurrencyDetector("c", ConcurrencyParameters(maxConcurrency=capacity))
    fc = FlowController(
        detector,
        lambda now: [state] if state.healthy else [],
        FlowQueues(**queues),  # type: ignore[arg-type]
        enabled=enabled,
        ttl_s=ttl_s,
    )
    return fc, state


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_room_means_no_wait() -> None:
    fc, _ = controller(in_flight=1)
    admission = await fc.admit(0, "t")
    assert (admission.queued, admission.waited_s) == (False, 0.0)
    assert fc.stats.outcomes == {(0, Outcome.DISPATCHED): 1}


async def test_saturated_requests_wait_until_notified() -> None:
    fc, state = controller(in_flight=2)
    task = asyncio.create_task(fc.admit(0, "t"))
    await settle()
    assert not task.done() and fc.queues.requests == 1
    state.in_flight_requests = 1
    fc.notify()
    admission = await task
    assert admission.queued and admission.waited_s >= 0.0
    assert fc.pending == 0


async def test_release_stops_at_capacity_counting_pending() -> None:
    fc, state = controller(in_flight=2, capacity=2)
    tasks = [asyncio.create_task(fc.admit(0, f"t{i}")) for i in range(5)]
    await settle()
    state.in_flight_requests = 0
    fc.notify()
    # 0 in flight + 2 pending = 2/2 → saturated after two releases
    assert fc.pending == 2 and fc.queues.requests == 3
    await settle()
    assert sum(t.done() for t in tasks) == 2 and fc.pending == 0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_strict_priority_on_release() -> None:
    fc, state = controller(in_flight=2)
    order: list[str] = []

    async def one(priority: int, name: str) -> None:
        await fc.admit(priority, name)
        order.append(name)

    tasks = [asyncio.create_task(one(0, "low")), asyncio.create_task(one(10, "high"))]
    await settle()
    state.in_flight_requests = 1
    fc.notify()
    await settle()
    assert order == ["high"]
    state.in_flight_requests = 1
    fc.notify()
    await asyncio.gather(*tasks)
    assert order == ["high", "low"]


async def test_ttl_expiry() -> None:
    fc, _ = controller(in_flight=2, ttl_s=0.05)
    with pytest.raises(Rejected) as info:
        await fc.admit(0, "t")
    assert info.value.outcome is Outcome.EVICTED_TTL
    assert info.value.reason == "rejected-ttl-expired"
    assert info.value.waited_s >= 0.05
    assert fc.queues.requests == 0


async def test_expiry_with_no_endpoints_left_is_503_reason() -> None:
    fc, state = controller(in_flight=2, ttl_s=0.05)
    task = asyncio.create_task(fc.admit(0, "t"))
    await settle()
    state.healthy = False
    with pytest.raises(Rejected) as info:
        await task
    assert info.value.reason == "rejected-no-endpoints"


async def test_client_cancel_leaves_the_queue() -> None:
    fc, _ = controller(in_flight=2)
    task = asyncio.create_task(fc.admit(0, "t"))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fc.queues.requests == 0
    assert fc.stats.outcomes[(0, Outcome.EVICTED_CONTEXT_CANCELLED)] == 1


async def test_cancel_after_release_gives_the_slot_on() -> None:
    fc, state = controller(in_flight=2, capacity=1)
    first = asyncio.create_task(fc.admit(0, "a"))
    second = asyncio.create_task(fc.admit(0, "b"))
    await settle()
    state.in_flight_requests = 0
    fc.notify()
    first.cancel()  # released, but its caller goes away before resuming
    await asyncio.gather(first, return_exceptions=True)
    assert (await second).queued
    assert fc.pending == 0


@pytest.mark.parametrize("enabled", [True, False], ids=["flow-control", "gate-off"])
async def test_negative_priority_is_shed_under_saturation(enabled: bool) -> None:
    fc, _ = controller(in_flight=2, enabled=enabled)
    with pytest.raises(Rejected) as info:
        await fc.admit(-1, "t")
    assert info.value.reason == "rejected-saturated"
    assert fc.queues.requests == 0


async def test_gate_off_lets_non_negative_through() -> None:
    fc, _ = controller(in_flight=5, enabled=False)
    assert not (await fc.admit(0, "t")).queued


async def test_full_band_rejects() -> None:
    fc, _ = controller(in_flight=2, default_band=BandLimits(max_requests=1, max_bytes=10**6))
    waiting = asyncio.create_task(fc.admit(0, "a"))
    await settle()
    with pytest.raises(Rejected) as info:
        await fc.admit(0, "b")
    assert info.value.outcome is Outcome.REJECTED_CAPACITY
    assert info.value.reason == "rejected-saturated"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_no_endpoints_rejects_at_once() -> None:
    fc, state = controller(in_flight=0)
    state.healthy = False
    with pytest.raises(Rejected) as info:
        await fc.admit(0, "t")
    assert info.value.reason == "rejected-no-endpoints"


async def test_close_turns_queued_requests_away() -> None:
    fc, _ = controller(in_flight=2)
    task = asyncio.create_task(fc.admit(0, "t"))
    await settle()
    assert fc.close() == 1
    with pytest.raises(Rejected) as info:
        await task
    assert info.value.outcome is Outcome.EVICTED_SHUTDOWN
    with pytest.raises(Rejected):
        await fc.admit(0, "t")


async def test_watchdog_rechecks_when_metrics_go_stale() -> None:
    # fresh and saturated now; stale after 50 ms → every endpoint stale → fail open
    state = endpoint_state("a:1", waiting=50, scraped_at=time.monotonic())
    detector = UtilizationDetector("u", UtilizationParameters(metricsStalenessThreshold="50ms"))
    fc = FlowController(detector, lambda now: [state], ttl_s=5.0)
    admission = await asyncio.wait_for(fc.admit(0, "t"), 2.0)
    assert admission.queued and admission.waited_s >= 0.05
    assert fc.stats.wakeups == 1
