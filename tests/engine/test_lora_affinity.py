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
import time
from collections.abc import Callable, Iterator

import pytest
from gateway_process import GatewayProcess, running_gateway
from inflight import holding, resume, wait_for

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


Routes = list[tuple[str, dict[str, object]]]


def while_running(
    server: VllmServer, adapters: list[str], check: Callable[[], Routes], attempts: int = 5
) -> Routes:
    """`check()` while long requests for `adapters` run on `server` (sent straight to it).

    `holding` starts the requests together; they then run for at least HOLD_TOKENS
    decode steps, with the engine resumed so that routed requests are served. A
    check they did not outlast says nothing, so it is run again with fresh requests.
    """
    for _ in range(attempts):
        with holding(server, running=adapters):
            resume(server)
            routes = check()
            if routes and running_adapters(server) == set(adapters):
                return routes
    raise AssertionError(f"{adapters} stopped running on {server.url} before the check ended")


def caught_up(gateway: GatewayProcess, model: str, server: VllmServer) -> bool:
    """Whether the gateway's scores show `model` running on `server` (its scrape lags)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if totals(route(gateway, model)[1]).get(server.address) == 1.0:
            return True
    return False


def test_adapter_requests_follow_the_replica_running_the_adapter(
    cluster: VllmCluster, lora_gateway: GatewayProcess
) -> None:
    if len(cluster) < 2:
        pytest.fail("LoRA-affinity routing needs at least 2 replicas")
    home = cluster[1]

    def check() -> Routes:
        if not caught_up(lora_gateway, "a1", home):
            return []
        return [route(lora_gateway, "a1") for _ in range(4)]

    for address, scores in while_running(home, ["a1"], check):
        # 1.0 where a1 runs; 0.8 where a slot is free
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

    def check() -> Routes:
        if not caught_up(lora_gateway, "a1", full):
            return []
        return [route(lora_gateway, "a3") for _ in range(4)] + [route(lora_gateway, "a2")]

    *to_free, (address, scores) = while_running(full, ["a1", "a2"], check)
    # a3: server 0 has both slots taken (0); the others have a free slot (0.8), or a3
    # running (1.0) once a scrape saw an earlier a3 request there
    for a3_address, a3_scores in to_free:
        assert a3_address in free, a3_scores
        seen = totals(a3_scores)
        assert seen.pop(full.address) == 0.0, a3_scores
        assert set(seen.values()) <= {0.8, 1.0}, a3_scores
    # a2 still goes where it runs (1.0 against 0.8)
    assert address == full.address, scores
    assert totals(scores)[full.address] == 1.0, scores
    _held(full, set())
