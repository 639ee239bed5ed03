"""The upstream Grafana dashboards get data from servegate.

The metric names and the labels each panel groups by were read from two
upstream dashboards (written out here by hand, not copied):

- kubernetes-sigs/gateway-api-inference-extension, `tools/dashboards/inference_gateway.json`
  (its last version, commit 66f265a9, before the file was removed in ebbb148c);
- llm-d/llm-d-router, `deploy/grafana/inference_gateway.json` (its last version, the parent
  of 5b4b90d39 that removed it), which queries the `llm_d_epp_*` names.

Panels on model-server series (`vllm:*`) are answered by the replicas, which the
simulator stands in for, and are checked on a replica's /metrics. Panels on
`bbr_*` belong to the Body-Based Router, a component servegate does not ship.

Traffic: two replicas behind flow control that admits one request per replica,
so requests queue and dispatch cycles run; two priorities and two fairness ids;
one request for an unknown model (an error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, chat, gateway_config, wait_ready

GIE_DASHBOARD: Mapping[str, tuple[str, ...]] = {
    "inference_pool_average_kv_cache_utilization": ("name",),
    "inference_pool_average_queue_size": ("name",),
    "inference_pool_per_pod_queue_size": ("name", "model_server_pod"),
    "inference_objective_request_duration_seconds_bucket": ("le",),
    "inference_objective_request_total": ("model_name", "target_model_name"),
    "inference_objective_request_error_total": ("error_code", "model_name", "target_model_name"),
    "inference_objective_request_sizes_bucket": ("le",),
    "inference_objective_response_sizes_bucket": ("le",),
    "inference_objective_input_tokens_bucket": ("le",),
    "inference_objective_output_tokens_bucket": ("le",),
    "inference_extension_flow_control_pool_saturation": ("inference_pool",),
    "inference_extension_flow_control_queue_size": ("priority", "fairness_id"),
    "inference_extension_flow_control_queue_bytes": ("priority", "fairness_id"),
    "inference_extension_flow_control_request_enqueue_duration_seconds_count": (
        "priority",
        "fairness_id",
    ),
    "inference_extension_flow_control_request_enqueue_duration_seconds_bucket": ("le",),
    "inference_extension_flow_control_request_queue_duration_seconds_count": (
        "priority",
        "fairness_id",
        "outcome",
    ),
    "inference_extension_flow_control_request_queue_duration_seconds_bucket": (
        "priority",
        "fairness_id",
        "le",
    ),
    "inference_extension_flow_control_dispatch_cycle_duration_seconds_bucket": ("le",),
}
"""GIE's dashboard: metric → the labels its panels group by."""

LLM_D_DASHBOARD: Mapping[str, tuple[str, ...]] = {
    "llm_d_epp_average_kv_cache_utilization": ("name",),
    "llm_d_epp_average_queue_size": ("name",),
    "llm_d_epp_per_endpoint_queue_size": ("name", "model_server_endpoint"),
    "llm_d_epp_request_duration_seconds_bucket": ("le",),
    "llm_d_epp_request_total": ("model_name", "target_model_name"),
    "llm_d_epp_request_error_total": ("error_code", "model_name", "target_model_name"),
    "llm_d_epp_request_size_bytes_bucket": ("le",),
    "llm_d_epp_response_size_bytes_bucket": ("le",),
    "llm_d_epp_request_input_tokens_bucket": ("le",),
    "llm_d_epp_request_output_tokens_bucket": ("le",),
    "llm_d_epp_flow_control_pool_saturation": ("inference_pool",),
    "llm_d_epp_flow_control_queue_size": ("priority", "fairness_id"),
    "llm_d_epp_flow_control_queue_bytes": ("priority", "fairness_id"),
    "llm_d_epp_flow_control_request_enqueue_duration_seconds_count": ("priority", "fairness_id"),
    "llm_d_epp_flow_control_request_enqueue_duration_seconds_bucket": ("le",),
    "llm_d_epp_flow_control_request_queue_duration_seconds_count": (
        "priority",
        "fairness_id",
        "outcome",
    ),
    "llm_d_epp_flow_control_request_queue_duration_seconds_bucket": (
        "priority",
        "fairness_id",
        "le",
    ),
    "llm_d_epp_flow_control_dispatch_cycle_duration_seconds_bucket": ("le",),
}
"""llm-d router's dashboard: metric → the labels its panels group by."""

GAUGES = (
    "_average_kv_cache_utilization",
    "_average_queue_size",
    "_per_pod_queue_size",
    "_per_endpoint_queue_size",
    "_queue_size",
    "_queue_bytes",
    "_pool_saturation",
)
"""Series whose value may rightly be 0 after the traffic (the queues have drained)."""

REPLICA_SERIES = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_to_first_token_seconds_bucket",
)
"""The model-server panels of GIE's dashboard."""

FLOW_CONTROL = {
    "enabled": True,
    "saturation_detector": {"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}},
    "objectives": [{"name": "critical", "priority": 10}],
}


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def missing(
    exposed: dict[str, list[tuple[dict[str, str], float]]], wanted: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """Dashboard series servegate does not answer: absent, without a grouped-by label, or
    (counters and histograms) never incremented by the traffic."""
    out = []
    for name, labels in wanted.items():
        rows = [(lab, v) for lab, v in exposed.get(name, []) if all(k in lab for k in labels)]
        if not rows:
            out.append(f"{name} (absent or without {', '.join(labels)})")
        elif not name.endswith(GAUGES) and not any(v > 0 for _, v in rows):
            out.append(f"{name} (never incremented)")
    return out


async def send(session: aiohttp.ClientSession, url: str, i: int) -> int:
    headers = {"x-llm-d-inference-fairness-id": f"tenant-{i % 2}"}
    if i % 3 == 0:
        headers["x-llm-d-inference-objective"] = "critical"
    async with session.post(
        url + "/v1/chat/completions", json=chat(f"question {i}", max_tokens=24), headers=headers
    ) as resp:
        await resp.read()
        return resp.status


async def test_gie_and_llm_d_dashboards_get_data() -> None:
    async with SimCluster(2, base=FAST_SIM) as cluster:
        cfg = gateway_config(cluster.urls)
        cfg["flow_control"] = FLOW_CONTROL
        async with GatewayRunner(cfg) as gw, aiohttp.ClientSession() as session:
            await wait_ready(gw, 2)
            statuses = await asyncio.gather(*(send(session, gw.url, i) for i in range(12)))
            assert statuses == [200] * 12
            async with session.post(
                gw.url + "/v1/chat/completions", json=chat(model="no-such-model")
            ) as resp:
                assert resp.status == 404
            text = await (await session.get(gw.url + "/metrics")).text()
            replica = await (await session.get(cluster.urls[0] + "/metrics")).text()
    exposed = samples(text)
    assert missing(exposed, GIE_DASHBOARD) == []
    assert missing(exposed, LLM_D_DASHBOARD) == []
    # requests really queued: the "Fairness Sharing Rate" panel filters on this outcome
    dispatched = [
        v
        for lab, v in exposed[
            "inference_extension_flow_control_request_queue_duration_seconds_count"
        ]
        if lab["outcome"] == "Dispatched"
    ]
    assert sum(dispatched) == 12
    fairness = {
        lab["fairness_id"]
        for lab, _ in exposed["llm_d_epp_flow_control_request_enqueue_duration_seconds_count"]
    }
    assert fairness == {"tenant-0", "tenant-1"}
    codes = {lab["error_code"] for lab, _ in exposed["inference_objective_request_error_total"]}
    assert codes == {"NotFound"}
    replica_exposed = samples(replica)
    assert [name for name in REPLICA_SERIES if name not in replica_exposed] == []
