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


def family_text(text: bytes, name: str) -> list[str]:
    """`name`'s lines (under every name it is exported as), creation times masked."""
    lines = [line for line in text.decode().splitlines() if name in line]
    return [re.sub(r"(_created\{[^}]*\}) \S+", r"\1 <t>", line) for line in lines]


def test_pd_decisions_render_as_prometheus_client_counters() -> None:
    metrics = GatewayMetrics(lambda: [])
    for kind in ("prefill-decode", "decode-only", "prefill-decode"):
        metrics.pd_decision("m", kind)
    registry = CollectorRegistry(auto_describe=True)
    for family in (metrics.disagg_decisions, *metrics.pd_decision_families):
        counter = Counter(
            family.name, family.documentation, ["model_name", "decision_type"], registry=registry
        )
        for kind in ("prefill-decode", "decode-only", "prefill-decode"):
            counter.labels("m", kind).inc()
    expected = generate_latest(registry)
    for name in ("disagg_decision", "pd_decision"):
        assert family_text(metrics.render(), name) == family_text(expected, name)
    assert family_text(metrics.render(), "llm_d_epp_pd_decision_total")


def test_model_rewrites_render_as_a_prometheus_client_counter() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.rewritten("split", "m", "t")
    metrics.rewritten("split", "m", "t")
    registry = CollectorRegistry(auto_describe=True)
    counter = Counter(
        metrics.rewrites.name,
        metrics.rewrites.documentation,
        ["model_rewrite_name", "model_name", "target_model"],
        registry=registry,
    )
    counter.labels("split", "m", "t").inc(2)
    name = "llm_d_epp_model_rewrite_decisions"
    assert family_text(metrics.render(), name) == family_text(generate_latest(registry), name)
