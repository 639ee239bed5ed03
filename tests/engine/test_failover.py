"""A replica killed mid-run: the gateway routes around it, drops it, and takes it back.

SIGKILL to a vLLM server's whole process group is what a crashed pod looks like
from outside. Requests sent right after the kill must all succeed (the gateway
retries before the first byte on another replica); the health checker must take
the dead one out of the pool within its failure threshold, and put it back once
the restarted server answers /health again.
"""

from __future__ import annotations

import time

import pytest
from gateway_process import GatewayProcess
from inflight import wait_for
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.vllm_cluster import VllmCluster

REQUEST = {"model": "tiny", "prompt": "still there?", "max_tokens": 4, "temperature": 0}


def ready_pods(gateway: GatewayProcess) -> float:
    for family in text_string_to_metric_families(gateway.metrics_text()):
        if family.name == "inference_pool_ready_pods":
            return sum(s.value for s in family.samples)
    raise AssertionError("inference_pool_ready_pods missing from the gateway's /metrics")


def test_killed_replica_leaves_the_pool_and_returns(
    cluster: VllmCluster, gateway: GatewayProcess
) -> None:
    if len(cluster) < 2:
        pytest.fail("the failover test needs at least 2 replicas (SERVEGATE_ENGINE_REPLICAS)")
    n = len(cluster)
    victim = cluster[n - 1]
    survivors = {s.address for s in cluster if s is not victim}
    gateway.wait_ready(n, timeout_s=10)
    victim.kill()
    killed_at = time.monotonic()
    try:
        for i in range(2 * n + 4):
            body = {**REQUEST, "stream": i % 2 == 1}
            status, headers, answer = gateway.post("/v1/completions", body)
            assert status == 200, answer[:300]
            assert headers["x-gateway-destination-endpoint"] in survivors
        gateway.wait_ready(n - 1, timeout_s=gateway.leave_bound_s)
        left_after = time.monotonic() - killed_at
        assert left_after <= gateway.leave_bound_s
        assert ready_pods(gateway) == n - 1
        assert gateway.ready()["ready_endpoints"] == n - 1
        status, _, _ = gateway.post("/v1/completions", REQUEST)
        assert status == 200
    finally:
        victim.start()
        victim.wait_healthy()
    gateway.wait_ready(n, timeout_s=gateway.leave_bound_s)
    assert ready_pods(gateway) == n

    def victim_serves_again() -> bool:
        status, headers, _ = gateway.post("/v1/completions", REQUEST)
        assert status == 200
        return headers["x-gateway-destination-endpoint"] == victim.address

    wait_for(victim_serves_again, timeout_s=60, what="the restarted replica to get requests")
