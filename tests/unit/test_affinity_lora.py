"""`lora-affinity-scorer` with real vLLM 0.32 semantics (scorers.LoraAffinityScorer).

vLLM publishes no `vllm:lora_requests_info` series until a replica's first
adapter request, and its running/waiting labels both list every adapter with a
request in flight. A fresh replica whose `/v1/models` lists adapters therefore
has free slots, not none.
"""

from __future__ import annotations

import random

import pytest

from servegate.pool.endpoint import Endpoint, EndpointState, LoraInfo
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scorers import LoraAffinityScorer


def state(lora: LoraInfo | None, served: frozenset[str] = frozenset()) -> EndpointState:
    s = EndpointState(Endpoint(address="a:1", url="http://a:1"), served_models=served)
    s.metrics.lora = lora
    return s


CYCLE = CycleState(now=0.0, rng=random.Random(0))


@pytest.mark.parametrize(
    ("endpoint", "score"),
    [
        pytest.param(state(None, frozenset({"tiny", "a1", "a2"})), 0.8, id="fresh-lists-adapter"),
        pytest.param(state(None, frozenset({"tiny", "a2"})), 0.8, id="fresh-lists-other-adapters"),
        pytest.param(state(None, frozenset({"tiny"})), 0.0, id="no-lora-at-all"),
        pytest.param(state(None), 0.0, id="nothing-known"),
        pytest.param(state(LoraInfo(2)), 0.8, id="series-with-empty-sets"),
        # vLLM lists a1 in both labels while its requests run: one slot used, one free
        pytest.param(
            state(LoraInfo(2, frozenset({"a1"}), frozenset({"a1"}))), 1.0, id="running-and-waiting"
        ),
        pytest.param(
            state(LoraInfo(2, frozenset({"a2"}), frozenset({"a2"}))), 0.8, id="one-slot-free"
        ),
        pytest.param(
            state(LoraInfo(2, frozenset({"a2", "a3"}), frozenset({"a2", "a3"}))), 0.0, id="full"
        ),
        pytest.param(
            state(LoraInfo(2, frozenset({"a2", "a3"}), frozenset({"a1"}))), 0.6, id="waiting"
        ),
    ],
)
def test_lora_affinity(endpoint: EndpointState, score: float) -> None:
    request = LLMRequest("r", RequestKind.COMPLETION, "a1", "a1", "tiny", lora="a1")
    assert LoraAffinityScorer().score(CYCLE, request, [endpoint]) == [score]


def _named(address: str, lora: LoraInfo | None) -> EndpointState:
    s = EndpointState(
        Endpoint(address=address, url=f"http://{address}"),
        served_models=frozenset({"tiny", "a1", "a2", "a3"}),
    )
    s.metrics.lora = lora
    s.metrics.scraped_at = 1.0
    return s


@pytest.mark.parametrize("seed", range(5))
def test_the_default_profile_sends_an_adapter_request_where_the_adapter_runs(seed: int) -> None:
    from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
    from servegate.scheduling.factory import PluginContext

    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext())
    endpoints = [
        _named("a:1", LoraInfo(2, frozenset({"a2", "a3"}))),  # both slots taken by others
        _named("b:1", LoraInfo(2, frozenset({"a1"}))),  # a1 running
        _named("c:1", LoraInfo(2, frozenset({"a2"}))),  # a slot free
    ]
    adapter = LLMRequest("r", RequestKind.COMPLETION, "a1", "a1", "tiny", lora="a1", prompt="x")
    cycle = CycleState(now=1.0, rng=random.Random(seed))
    assert scheduler.schedule(adapter, endpoints, cycle).endpoint.address == "b:1"
    base = LLMRequest("r", RequestKind.COMPLETION, "tiny", "tiny", "tiny", prompt="x")
    result = scheduler.schedule(base, endpoints, cycle).results["default"]
    lora = {a: row["lora-affinity-scorer"] for a, row in result.scores.items()}
    assert len(set(lora.values())) == 1, lora
