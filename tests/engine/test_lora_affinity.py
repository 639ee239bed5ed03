"""LoRA-affinity routing with vLLM's real `vllm:lora_requests_info`.

A gateway whose only scorer is `lora-affinity-scorer` routes adapter requests.
Long adapter requests sent straight to one server (not through the gateway, so the
gateway's own in-flight counts play no part) put that server in a known LoRA state,
which the gateway learns only from the engine's metrics.

vLLM adds its `vllm:lora_requests_info` series only with the first adapter request
it serves; until then a replica publishes no LoRA state and the scorer gives it 0.
The fixture sends each server one adapter request first, so every replica starts
from "a slot is free" (0.8).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from gateway_process import GatewayProcess, running_gateway
from inflight import inflight, long_completion, wait_for

from servegate.testing.vllm_cluster import VllmCluster, VllmServer

PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "lora-affinity-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "lora-affinity-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}


@pytest.fixture(scope="module")
def lora_gateway(
    cluster: VllmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    for server in cluster:
        server.post("/v1/completions", {"model": "a3", "prompt": "warm", "max_tokens": 1})
    with running_gateway(
        cluster.servers,
        tmp_path_factory.mktemp("gateway-lora"),
        name="gateway-lora",
        picker=PICKER,
        debug_headers=True,
    ) as proc:
        yield proc


def running_adapters(server: VllmServer) -> set[str]:
    best: tuple[float, set[str]] = (-1.0, set())
    for line in server.metrics_text().splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            labels, value = line.rsplit(" ", 1)
            running = labels.split('running_lora_adapters="', 1)[1].split('"', 1)[0]
            if float(value) > best[0]:
                best = (float(value), {a for a in running.split(",") if a})
    return best[1]


def route(gateway: GatewayProcess, model: str) -> tuple[str, dict[str, object]]:
    body = {"model": model, "prompt": f"route {model}", "max_tokens": 2, "temperature": 0}
    status, headers, answer = gateway.post("/v1/completions", body)
    assert status == 200, answer[:300]
    scores = json.loads(headers["x-servegate-scores"])
    return headers["x-gateway-destination-endpoint"], scores


def totals(scores: dict[str, object]) -> dict[str, float]:
    """Per-endpoint weighted totals from the gateway's `x-servegate-scores` debug header."""
    raw = scores["totals"]
    assert isinstance(raw, dict), scores
    return {str(k): float(v) for k, v in raw.items()}


def _held(server: VllmServer, adapters: set[str]) -> None:
    wait_for(
        lambda: running_adapters(server) == adapters,
        timeout_s=30,
        what=f"{sorted(adapters)} running on {server.url}",
    )


def test_adapter_requests_follow_the_replica_running_the_adapter(
    cluster: VllmCluster, lora_gateway: GatewayProcess
) -> None:
    if len(cluster) < 2:
        pytest.fail("LoRA-affinity routing needs at least 2 replicas")
    home = cluster[1]
    with inflight(home.url, [long_completion("a1", "keep a1 busy")]):
        _held(home, {"a1"})
        # 1.0 where a1 runs; 0.8 where a slot is free
        wait_for(
            lambda: route(lora_gateway, "a1")[0] == home.address,
            timeout_s=5,
            what="the gateway to see a1 running on server 1",
        )
        for _ in range(4):
            address, scores = route(lora_gateway, "a1")
            assert address == home.address, scores
            assert totals(scores) == {s.address: 1.0 if s is home else 0.8 for s in cluster}
    _held(home, set())


def test_a_full_replica_sends_a_new_adapter_elsewhere(
    cluster: VllmCluster, lora_gateway: GatewayProcess
) -> None:
    if len(cluster) < 2:
        pytest.fail("LoRA-affinity routing needs at least 2 replicas")
    full = cluster[0]
    free = {s.address for s in cluster if s is not full}
    bodies = [long_completion(a, f"fill slot {a}") for a in ("a1", "a2")]
    with inflight(full.url, bodies):
        _held(full, {"a1", "a2"})
        wait_for(
            lambda: route(lora_gateway, "a1")[0] == full.address,
            timeout_s=5,
            what="the gateway to see a1 and a2 running on server 0",
        )
        # a3: server 0 has both slots taken (0), the others a free slot (0.8)
        for _ in range(4):
            address, scores = route(lora_gateway, "a3")
            assert address in free, scores
            assert totals(scores) == {s.address: 0.0 if s is full else 0.8 for s in cluster}
        # a2 still goes where it runs (1.0 against 0.8)
        address, scores = route(lora_gateway, "a2")
        assert address == full.address, scores
        assert totals(scores) == {s.address: 1.0 if s is full else 0.8 for s in cluster}
    _held(full, set())
