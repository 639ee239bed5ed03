"""The default profile's one-call path (`scheduling/sticky.py`) against the plugin-by-plugin
path: the same decisions, scores, filter outcomes, request cache entries and rng draws."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.affinity import NoHitLRUScorer
from servegate.scheduling.affinity_filter import PrefixCacheAffinityFilter
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState, NoCandidates
from servegate.scheduling.prefix.lookup import already_scored
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler, result_as_dict
from servegate.scheduling.sticky import StickyPath
from servegate.testing.endpoints import random_endpoint_states

HEADS = [f"system prompt {i}: " + "you are a helpful assistant. " * 8 for i in range(4)]

DELTA_ONLY = DEFAULT_PICKER_CONFIG
TTFT_GATE = DEFAULT_PICKER_CONFIG.replace(
    "{maxInFlightRequestsDelta: 3, prefixMatchInfoProducerName: prefix-cache-scorer}",
    "{maxTTFTPenaltyMs: 2.0, maxTokensInFlightPenalty: 5000, affinityThreshold: 0.5, "
    "prefixMatchInfoProducerName: prefix-cache-scorer}",
)


def _scheduler(config: str, sticky: bool) -> Scheduler:
    scheduler = load_picker_config(config, PluginContext(staleness_s=2.0))
    scheduler.timing_every = 1 << 30  # untimed after the first cycle
    if not sticky:
        scheduler._sticky = None
    return scheduler


def _request(rng: random.Random, i: int) -> LLMRequest:
    head = rng.choice(HEADS)
    tail = rng.choice(["", "short question", "a longer question " * rng.randint(1, 20)])
    prompt = head + tail if rng.random() < 0.9 else f"{i} {tail} new prompt " * 10
    lora = rng.choice([None, None, None, "a1", "a3"])
    return LLMRequest(
        request_id=f"r{i}",
        kind=RequestKind.CHAT,
        model=lora or "base",
        target_model=lora or "base",
        base_model="base",
        lora=lora,
        prompt=prompt,
        messages=[{"role": "user", "content": prompt}],
        prompt_tokens=len(prompt) // 4,
        max_tokens=64,
    )


def _observed(scheduler: Scheduler) -> dict[str, Any]:
    flt = next(p for p in scheduler.plugins.values() if isinstance(p, PrefixCacheAffinityFilter))
    no_hit = next(p for p in scheduler.plugins.values() if isinstance(p, NoHitLRUScorer))
    return {"outcomes": dict(flt.decisions), "placements": list(no_hit.lru)}


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (scores of endpoints never scraped)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


@pytest.mark.parametrize("config", [DELTA_ONLY, TTFT_GATE], ids=["delta", "ttft-gate"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_decisions_scores_and_side_effects(config: str, seed: int) -> None:
    fast, slow = _scheduler(config, True), _scheduler(config, False)
    assert fast._sticky is not None
    rng = random.Random(seed)
    pools = {label: random_endpoint_states(10, random.Random(seed)) for label in ("fast", "slow")}
    for state in pools["fast"] + pools["slow"]:
        state.in_flight_requests = state.in_flight_tokens = 0
    rng_fast, rng_slow = random.Random(seed + 10), random.Random(seed + 10)
    for i in range(600):
        n = rng.randint(1, 10)  # above 8 both take the general path
        picks = sorted(rng.sample(range(10), n))
        never_scraped = rng.random() < 0.1
        load = [(rng.randint(0, 12), rng.randint(0, 9000)) for _ in range(10)]
        request_seed = rng.random()
        decisions = []
        for label, scheduler, cycle_rng in (
            ("fast", fast, rng_fast),
            ("slow", slow, rng_slow),
        ):
            states: list[EndpointState] = pools[label]
            for state, (requests, tokens) in zip(states, load, strict=True):
                state.in_flight_requests, state.in_flight_tokens = requests, tokens
            states[0].metrics.scraped_at = 0.0 if never_scraped else 99.5
            candidates = [states[j] for j in picks]
            request = _request(random.Random(request_seed), i)
            cycle = CycleState(now=100.0 + i, rng=cycle_rng)
            try:
                decision = scheduler.schedule(request, candidates, cycle)
            except NoCandidates:
                decisions.append(None)
                continue
            # what the latency layer's dispatch reads after the decision
            left = already_scored(cycle, "prefix-cache-scorer", [decision.endpoint])
            scheduler.pre_request(request, decision, 100.0 + i)
            result = decision.results[decision.profile]
            decisions.append(
                (
                    [s.address for s in decision.targets],
                    result_as_dict(result),
                    {k: v for k, v in request.cache.items() if not k.startswith("prefix.")},
                    _observed(scheduler),
                    None if left is None else list(left),
                    cycle_rng.random(),
                )
            )
        assert _same(decisions[0], decisions[1]), i


def test_other_shapes_take_the_general_path() -> None:
    lone_filter = DEFAULT_PICKER_CONFIG.replace(
        "- {pluginRef: no-hit-lru-scorer, weight: 1}\n",
        "- {pluginRef: no-hit-lru-scorer, weight: 1}\n  - {pluginRef: session}\n",
    ).replace(
        "- type: max-score-picker\n",
        "- type: max-score-picker\n- type: session-affinity-scorer\n  name: session\n",
    )
    assert _scheduler(lone_filter, True)._sticky is None
    exploring = DEFAULT_PICKER_CONFIG.replace(
        "maxInFlightRequestsDelta: 3,", "maxInFlightRequestsDelta: 3, explorationProbability: 0.1,"
    )
    assert _scheduler(exploring, True)._sticky is None
    profile = _scheduler(DEFAULT_PICKER_CONFIG, True).profiles["default"]
    assert StickyPath.of(profile) is not None
