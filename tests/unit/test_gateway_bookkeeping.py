"""The per-request bookkeeping kept in plain numbers renders as prometheus_client would."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as client_metrics

from servegate.gateway.metrics import GatewayMetrics

STATUSES = (200, 200, 404, 200, 503)


def responses_text(text: bytes) -> list[str]:
    """The response counter's lines, creation times masked (they differ run to run)."""
    lines = [line for line in text.decode().splitlines() if "servegate_http_responses" in line]
    return [re.sub(r"(_created\{[^}]*\}) \S+", r"\1 <t>", line) for line in lines]


def reference(statuses: tuple[int, ...]) -> bytes:
    registry = CollectorRegistry(auto_describe=True)
    counter = Counter(
        "servegate_http_responses", "Responses sent by status code.", ["code"], registry=registry
    )
    for status in statuses:
        counter.labels(str(status)).inc()
    return generate_latest(registry)


def test_the_response_counter_renders_as_a_prometheus_client_counter() -> None:
    metrics = GatewayMetrics(lambda: [])
    for status in STATUSES:
        metrics.response(status).inc()
    ours = responses_text(metrics.render())
    assert ours == responses_text(reference(STATUSES))
    assert 'servegate_http_responses_total{code="200"} 3.0' in ours
    assert any(line.startswith("servegate_http_responses_created") for line in ours)


def test_disabled_created_series_are_left_out_as_prometheus_client_leaves_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_metrics, "_use_created", False)
    metrics = GatewayMetrics(lambda: [])
    metrics.response(200).inc()
    ours = responses_text(metrics.render())
    assert ours == responses_text(reference((200,)))
    assert not any("_created" in line for line in ours)


def test_a_response_child_is_created_once_per_status() -> None:
    metrics = GatewayMetrics(lambda: [])
    assert metrics.response(200) is metrics.response(200)
    assert metrics.response(200) is not metrics.response(500)
