"""The latency predictor learns real vLLM's time to first token from the streams it relays.

A gateway with the SLO profile of docs/latency-routing.md (prefix-cache-scorer,
predicted-latency-producer, latency-scorer) relays a mixed workload from three
clients: short chats behind a few shared system prompts and long documents that
recur. Every prediction is made at dispatch, before the request's own TTFT is
learned, so the error over the later requests is the error on requests the model
had not seen (read from the access log: `predicted_ttft_ms` against `ttft_ms`, both
from arrival, the engine-side part being what remains after `dispatched_ms`).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from gateway_process import GatewayProcess, running_gateway

from servegate.testing.vllm_cluster import VllmCluster

REQUESTS = 60
LATER_MAPE_BOUND = 0.9
"""TTFT MAPE over the later half. Measured: this test 60.3 % (first quarter 62.4 %,
2 servers), bench/latency_slo.py --vllm 3 51–54 %, both on the loaded 2-core machine
(docs/benchmarks.md); the bound leaves room for a noisier run. A predictor that learns nothing stays at its priors (a 50 ms
TTFT against 0.2–4 s measured: above 90 %)."""
PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
        {"type": "latency-scorer", "parameters": {"headroomSelectionStrategy": "most"}},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "predicted-latency-producer"},
                {"pluginRef": "latency-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "light",
    "paper",
    "green",
    "orange",
    "violet",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    systems = [f"System {i}. " + words(rng, 120) for i in range(3)]
    docs = [f"Document {i}. " + words(rng, 450) for i in range(4)]
    bodies = []
    for i in range(REQUESTS):
        if rng.random() < 0.7:
            prompt, tokens = rng.choice(systems) + f"\nUser {i}: " + words(rng, 12), 8
        else:
            prompt, tokens = rng.choice(docs) + f"\nQuestion {i}: " + words(rng, 10), 12
        bodies.append({
            "model": "tiny", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        })  # fmt: skip
    return bodies


@pytest.fixture(scope="module")
def latency_gateway(cluster: VllmCluster, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_gateway(
        cluster.servers,
        tmp_path_factory.mktemp("gateway-latency"),
        name="gateway-latency",
        picker=PICKER,
    ) as proc:
        yield proc


def access_lines(gw: GatewayProcess) -> list[dict[str, Any]]:
    out = []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"servegate.access"' in line:
            out.append(json.loads(line))
    return out


def test_the_predictor_learns_real_ttft(latency_gateway: GatewayProcess) -> None:
    gw = latency_gateway
    bodies = workload(seed=3)

    def send(body: dict[str, Any]) -> int:
        status, _, answer = gw.post("/v1/completions", body)
        assert b"data: [DONE]" in answer
        return status

    with ThreadPoolExecutor(3) as pool:
        assert set(pool.map(send, bodies)) == {200}
    deadline = time.monotonic() + 10.0  # the access line is written as the request ends
    while True:
        lines = [x for x in access_lines(gw) if x.get("predicted_ttft_ms") is not None]
        if len(lines) >= REQUESTS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    lines.sort(key=lambda x: x["ts"])
    assert len(lines) == REQUESTS
    assert all(x["ttft_ms"] > x["dispatched_ms"] for x in lines)
    errors = [
        abs(x["predicted_ttft_ms"] - x["ttft_ms"]) / (x["ttft_ms"] - x["dispatched_ms"])
        for x in lines
    ]
    later = statistics.mean(errors[REQUESTS // 2 :])
    first = statistics.mean(errors[: REQUESTS // 4])
    print(f"TTFT MAPE: first quarter {first:.1%}, later half {later:.1%}")
    assert later < LATER_MAPE_BOUND
    page = gw.metrics_text()
    learned = sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("servegate_latency_prediction_observations_total{")
        and 'target="ttft"' in line
    )
    assert learned == REQUESTS
