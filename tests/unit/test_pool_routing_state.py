"""What routing learned belongs to the pool: a picker reload keeps prefix indexes and
session bindings, and the new scheduler routes on them (gateway/pools.py, RoutingState)."""

from __future__ import annotations

import random
from typing import Any

from servegate.config import ServegateConfig
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.pools import PoolRuntime, build_runtime
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.affinity import NoHitLRUScorer, SessionAffinityScorer
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.events import BlockStored, EventBatch
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.routing_state import APPROX_INDEX, RoutingState

ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def picker(queue_weight: float, lru_capacity: int = 31250) -> dict[str, Any]:
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": lru_capacity}},
            {"type": "precise-prefix-cache-scorer"},
            {"type": "session-affinity-scorer", "parameters": {"strategy": "session_id"}},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "precise-prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "session-affinity-scorer", "weight": 5},
                    {"pluginRef": "queue-scorer", "weight": queue_weight},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def config(doc: dict[str, Any]) -> ServegateConfig:
    return ServegateConfig.model_validate(
        {"pool": {"endpoints": [{"url": f"http://{a}"} for a in ADDRESSES]}, "picker": doc}
    )


def runtime(doc: dict[str, Any], previous: tuple[PoolRuntime, ...] = ()) -> PoolRuntime:
    cfg = config(doc)
    return build_runtime(cfg, cfg.pool_entries()[0], GatewayMetrics(lambda: []), None, previous)


def plugin(rt: PoolRuntime, kind: type[Any]) -> Any:
    return next(p for p in rt.scheduler.plugins.values() if isinstance(p, kind))


def candidates(rt: PoolRuntime) -> list[EndpointState]:
    states = [rt.pool.get(a) for a in ADDRESSES]
    assert all(s is not None for s in states)
    return [s for s in states if s is not None]


def request(prompt: str, **headers: str) -> LLMRequest:
    return LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt=prompt, headers=headers)


def route(rt: PoolRuntime, req: LLMRequest, seed: int, now: float) -> Decision:
    decision = rt.scheduler.schedule(req, candidates(rt), CycleState(now, random.Random(seed)))
    rt.scheduler.pre_request(req, decision, now)
    return decision


def test_a_picker_reload_keeps_prefix_indexes_and_session_bindings_and_routes_on_them() -> None:
    first = runtime(picker(queue_weight=1))
    prompt = "the shared system prompt " * 40
    learned = route(first, request(prompt), seed=1, now=1.0).endpoint.address
    bound = route(first, request("hello " * 40, **{"x-session-id": "u1"}), seed=2, now=2.0)
    session_address = bound.endpoint.address
    old_precise = plugin(first, PrecisePrefixCacheScorer)
    old_precise.index.apply(
        ADDRESSES[2], EventBatch(0.0, [BlockStored((7,), None, tuple(range(16)), 16)])
    )

    second = runtime(picker(queue_weight=2), previous=(first,))
    assert second.state is first.state and second.scheduler is not first.scheduler

    approx = plugin(second, PrefixCacheScorer)
    assert approx is not plugin(first, PrefixCacheScorer)
    keys = approx.block_keys(request(prompt))
    assert approx.index.match_lengths(keys, list(ADDRESSES)) == {
        a: (len(keys) if a == learned else 0) for a in ADDRESSES
    }
    precise = plugin(second, PrecisePrefixCacheScorer)
    assert precise.index is old_precise.index and precise.index.blocks(ADDRESSES[2]) == 1
    sessions = plugin(second, SessionAffinityScorer)
    assert sessions.bindings["u1"] == (session_address, 2.0)

    # the new scheduler routes on what the old one learned, whatever its tie-break seed
    for seed in range(8):
        assert route(second, request(prompt), seed, now=3.0).endpoint.address == learned
        other_prompt = request(f"turn {seed} " * 40, **{"x-session-id": "u1"})
        assert route(second, other_prompt, seed, now=3.0).endpoint.address == session_address


def test_a_picker_reload_keeps_where_cold_requests_went() -> None:
    """The default profile's no-hit-lru: after a reload, the next cold request still goes to
    the replica least recently given one, not back to the first in candidate order."""

    def with_lru(queue_weight: float) -> dict[str, Any]:
        doc = picker(queue_weight)
        doc["plugins"].append({"type": "no-hit-lru-scorer"})
        doc["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": "no-hit-lru-scorer"})
        return doc

    first = runtime(with_lru(1))
    given = [
        route(first, request(f"cold {i} " * 40), seed=i, now=1.0).endpoint.address for i in range(2)
    ]
    assert len(set(given)) == 2
    second = runtime(with_lru(2), previous=(first,))
    assert plugin(second, NoHitLRUScorer) is not plugin(first, NoHitLRUScorer)
    assert list(plugin(second, NoHitLRUScorer).lru) == given
    (never,) = set(ADDRESSES) - set(given)
    assert route(second, request("cold 9 " * 40), seed=9, now=2.0).endpoint.address == never


def test_the_kv_event_manager_feeds_the_pools_own_precise_index() -> None:
    first = runtime(picker(queue_weight=1))
    second = runtime(picker(queue_weight=2), previous=(first,))
    manager = second.cache_routing.kv_events
    assert manager is not None
    shared = plugin(second, PrecisePrefixCacheScorer).index
    assert shared is plugin(first, PrecisePrefixCacheScorer).index
    assert any(index is shared for index in manager.indexes)


def test_an_index_whose_settings_change_starts_afresh() -> None:
    first = runtime(picker(queue_weight=1))
    route(first, request("the shared system prompt " * 40), seed=1, now=1.0)
    assert len(plugin(first, PrefixCacheScorer).index) > 0
    second = runtime(picker(queue_weight=1, lru_capacity=100), previous=(first,))
    assert second.state is first.state
    assert len(plugin(second, PrefixCacheScorer).index) == 0


def test_the_routing_state_keeps_a_piece_per_plugin_and_tells_its_subscribers() -> None:
    state = RoutingState()
    made: list[int] = []

    def build() -> list[int]:
        made.append(1)
        return []

    one = state.shared(APPROX_INDEX, "p", "a", list, build)
    assert state.shared(APPROX_INDEX, "p", "a", list, build) is one
    assert state.shared(APPROX_INDEX, "q", "a", list, build) is not one
    assert state.shared(APPROX_INDEX, "p", "b", list, build) is not one
    assert len(made) == 3
    heard: list[tuple[str, str, tuple[int, ...], int | None]] = []

    def listener(plugin: str, address: str, keys: Any, capacity: int | None) -> None:
        heard.append((plugin, address, tuple(keys), capacity))

    state.subscribe(listener)
    state.subscribe(listener)
    state.inserted("p", "a:1", [1, 2], None)
    state.unsubscribe(listener)
    state.inserted("p", "a:1", [3], 5)
    assert heard == [("p", "a:1", (1, 2), None)]
