"""Routing signals per pool, and prefix indexes that forget departed or restarted replicas."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from servegate.config import ServegateConfig
from servegate.gateway.cache_routing import build_cache_routing
from servegate.pool.endpoint import Endpoint, EndpointMetrics
from servegate.pool.pool import Pool
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import Decision
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.events import AllBlocksCleared, BlockStored, EventBatch
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def setup(addresses: tuple[str, ...] = (A, B), **pool: Any) -> tuple[Any, Pool, Any]:
    config = ServegateConfig.model_validate(
        {"pool": {"endpoints": [{"url": f"http://{a}"} for a in addresses], **pool}}
    )
    p = Pool()
    for ep in config.pool.endpoints:
        p.add(ep.to_endpoint("default"))
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext())
    registry = CollectorRegistry()
    routing = build_cache_routing(config, p, scheduler, registry)
    return routing, p, (scheduler, registry)


def approx(scheduler: Any) -> PrefixCacheScorer:
    return next(p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheScorer))


def route(scorer: PrefixCacheScorer, pool: Pool, address: str) -> list[int]:
    request = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt="x" * 640)
    state = pool.get(address)
    assert state is not None
    scorer.pre_request(request, Decision(endpoint=state, fallbacks=[]), 0.0)
    return scorer.block_keys(request)


def held(scorer: PrefixCacheScorer, keys: list[int], address: str) -> int:
    return scorer.index.match_lengths(keys, [address])[address]


def test_a_replica_that_leaves_the_pool_is_forgotten() -> None:
    _, pool, (scheduler, _) = setup()
    scorer = approx(scheduler)
    keys = route(scorer, pool, A)
    assert held(scorer, keys, A) == len(keys) > 0
    pool.remove(A)
    assert held(scorer, keys, A) == 0
    pool.add(Endpoint(address=A, url=f"http://{A}"))
    assert held(scorer, keys, A) == 0


def test_counters_going_backwards_mean_a_restarted_engine_with_an_empty_cache(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, pool, (scheduler, _) = setup()
    scorer = approx(scheduler)
    precise = next(p for p in scheduler.plugins.values() if isinstance(p, PrecisePrefixCacheScorer))
    keys = route(scorer, pool, A)
    keys_b = route(scorer, pool, B)
    precise.index.apply(A, EventBatch(0.0, [BlockStored((1,), None, tuple(range(16)), 16)]))
    assert precise.index.blocks(A) == 1
    pool.set_metrics(A, EndpointMetrics(prefix_cache_queries=500.0))
    pool.set_metrics(A, EndpointMetrics(prefix_cache_queries=900.0))
    assert held(scorer, keys, A) == len(keys)
    with caplog.at_level(logging.INFO):
        pool.set_metrics(A, EndpointMetrics(prefix_cache_queries=40.0))
    assert held(scorer, keys, A) == 0 and precise.index.blocks(A) == 0
    assert held(scorer, keys_b, B) == len(keys_b)
    assert any("restarted" in r.getMessage() for r in caplog.records)


def test_all_blocks_cleared_empties_the_approximate_index_too() -> None:
    routing, pool, (scheduler, _) = setup()
    scorer = approx(scheduler)
    keys = route(scorer, pool, A)
    assert routing.janitor is not None and routing.kv_events is not None
    assert routing.janitor in routing.kv_events.indexes
    routing.janitor.apply(A, EventBatch(0.0, [AllBlocksCleared()]))
    assert held(scorer, keys, A) == 0


def test_signals_say_what_is_live_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    routing, pool, (_, registry) = setup()
    signals = routing.signals
    assert signals is not None
    found = signals.signals()
    assert found["tokenizer"]["*"]["source"] == "auto"
    assert set(found["scorers"]) == {"precise-prefix-cache-scorer", "prefix-cache-scorer"}
    for address in (A, B):
        ep = found["endpoints"][address]
        # alone on its host: llm-d's convention, nothing received yet
        assert ep["kv_events"]["kv_events"] == f"tcp://{address.split(':')[0]}:5557"
        assert ep["kv_events"]["receiving"] is False
        assert ep["block_size_origin"] == "assumed"
    pool.set_metrics(A, EndpointMetrics(block_size=32, num_blocks=128))
    found = signals.signals()
    assert found["endpoints"][A]["block_size"] == 32
    assert found["endpoints"][A]["block_size_origin"] == "metrics"
    assert any("no replica's KV events" in p for p in found["problems"])
    with caplog.at_level(logging.WARNING):
        signals.check()
        signals.check()
    assert len([r for r in caplog.records if "cannot contribute" in r.getMessage()]) == 1
    samples = {
        (s.labels["signal"], s.labels["endpoint"], s.labels["source"]): s.value
        for family in registry.collect()
        if family.name == "servegate_routing_signal"
        for s in family.samples
    }
    assert samples[("block_size", A, "metrics")] == 1.0
    assert samples[("block_size", B, "assumed")] == 0.0
    assert samples[("kv_events", A, "tcp://10.0.0.1:5557")] == 0.0


def test_replicas_sharing_a_host_are_not_auto_subscribed() -> None:
    routing, pool, _ = setup(("10.0.0.1:8000", "10.0.0.1:8001"))
    found = routing.signals.signals()
    for ep in found["endpoints"].values():
        assert "shares its host" in ep["kv_events"]["kv_events"]
    assert routing.kv_events.resolve(pool.get("10.0.0.1:8000").endpoint) is None


def test_a_configured_tokenizer_is_reported() -> None:
    routing, _, _ = setup(tokenizer={"source": "simulator"})
    assert routing.signals.signals()["tokenizer"]["*"]["source"].startswith("servegate-builtin")


def test_a_publisher_sending_garbage_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    from servegate.datalayer.kvevents.transport import SubscriberStats

    routing, _, _ = setup()
    manager = routing.kv_events
    assert manager is not None

    class Stub:
        replay_endpoint = None

        def __init__(self, stats: SubscriberStats) -> None:
            self.stats = stats

    garbage = SubscriberStats(messages=5)
    garbage.drop("bad-payload", 5)
    manager.subscribers[A] = Stub(garbage)  # type: ignore[assignment]
    manager.subscribers[B] = Stub(SubscriberStats(messages=3, batches=3))  # type: ignore[assignment]
    signals = routing.signals
    assert signals is not None
    with caplog.at_level(logging.WARNING):
        signals.check()
        signals.check()
    said = [r.getMessage() for r in caplog.records if "none decode" in r.getMessage()]
    assert len(said) == 1 and A in said[0] and B not in said[0]
    assert signals.signals()["endpoints"][B]["kv_events"]["receiving"] is True
