"""Print flow control's /metrics text after a fixed set of admissions, to diff two checkouts.

    PYTHONPATH=/other/src .venv/bin/python bench/flow_render.py > /tmp/a.txt
    .venv/bin/python bench/flow_render.py > /tmp/b.txt && diff /tmp/a.txt /tmp/b.txt

Through `GatewayAdmission.admit` on a one-endpoint pool (concurrency detector, at most
one in flight): requests dispatched at once on three flows and two priorities, one
sheddable request shed on the saturated pool, one queued and then released by a
completion, one turned away with no endpoint. The durations' buckets and sums and the
`_created` timestamps are masked (they differ run to run); every series, its count and
every counter and gauge stay. A change to how flow control keeps
its series must leave this text as it was.
"""

from __future__ import annotations

import asyncio
import re

from prometheus_client import CollectorRegistry, generate_latest

from servegate.control.errors import GatewayError
from servegate.gateway.admission import build_admission
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool
from servegate.scheduling.flowcontrol import FlowControlSettings
from servegate.scheduling.request import LLMRequest, RequestKind

SETTINGS = FlowControlSettings.model_validate(
    {
        "enabled": True,
        "saturation_detector": {
            "type": "concurrency-detector",
            "parameters": {"maxConcurrency": 1},
        },
        "objectives": [{"name": "critical", "priority": 10}, {"name": "batch", "priority": -1}],
    }
)


def request(flow: str = "t", objective: str = "", target: str = "m") -> LLMRequest:
    headers = {"x-llm-d-inference-objective": objective} if objective else {}
    return LLMRequest("r", RequestKind.CHAT, "m", target, "m", headers=headers, fairness_id=flow)


async def scenario() -> str:
    pool = Pool()
    state = pool.add(Endpoint("a:1", "http://a:1"))
    pool.set_health(state.address, True)
    registry = CollectorRegistry()
    admission = build_admission(SETTINGS, pool, registry)
    for flow in ("a", "b", "", "a"):
        await admission.admit(request(flow, target="m2"), 10)
    await admission.admit(request(objective="critical"), 5)
    state.in_flight_requests = 1
    try:
        await admission.admit(request(objective="batch"), 5)
    except GatewayError as exc:
        print("shed:", exc.status, exc.message)
    queued = asyncio.create_task(admission.admit(request(), 7))
    await asyncio.sleep(0)
    state.in_flight_requests = 0
    admission.completed()
    await queued
    pool.eject(state.address, 1e12)
    try:
        await admission.admit(request(), 5)
    except GatewayError as exc:
        print("no endpoint:", exc.status, exc.message)
    text = generate_latest(registry).decode()
    text = re.sub(r"(_created\S* )\S+", r"\1X", text)
    return re.sub(r"(duration_seconds_(sum|bucket)(\{[^}]*\})? )\S+", r"\1X", text)


if __name__ == "__main__":
    print(asyncio.run(scenario()), end="")
