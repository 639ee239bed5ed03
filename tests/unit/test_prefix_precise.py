"""The precise prefix index and `precise-prefix-cache-scorer`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from servegate.datalayer.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)
from servegate.datalayer.kvevents.settings import (
    ChosenKVEvents,
    KVEventsSettings,
    kv_events_settings,
)
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.hashing import token_block_hashes
from servegate.scheduling.prefix.precise import (
    PreciseIndex,
    PrecisePrefixCacheScorer,
    PrecisePrefixParameters,
    lora_seed,
    parse_duration,
)
from servegate.scheduling.request import LLMRequest, RequestKind

FIXTURES = Path(__file__).parents[1] / "fixtures" / "real" / "kv_events"
BS = 4
PROMPT = list(range(1000, 1018))  # 18 tokens: 4 full blocks of 4, 2 left over


def stored(
    hashes: list[Any],
    tokens: list[int],
    parent: Any = None,
    medium: str | None = "GPU",
    lora: str | None = None,
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, lora, medium)


def batch(*events: Any) -> EventBatch:
    return EventBatch(0.0, list(events))


def index_with(*events: Any, address: str = "a", **kw: Any) -> PreciseIndex:
    index = PreciseIndex(**kw)
    index.apply(address, batch(*events))
    return index


@pytest.mark.parametrize(
    ("events", "expected_blocks"),
    [
        pytest.param([stored([1, 2], PROMPT[:8])], 2, id="first-two-blocks"),
        pytest.param(
            [stored([1, 2], PROMPT[:8]), stored([3], PROMPT[8:12], parent=2)],
            3,
            id="chained-by-parent",
        ),
        pytest.param(
            [stored([1, 2], PROMPT[:8]), stored([3], PROMPT[8:12], parent=99)],
            2,
            id="unknown-parent-dropped",
        ),
        pytest.param(
            [stored([1, 2, 3, 4], PROMPT[:16]), BlockRemoved([3], "GPU")],
            2,
            id="removed-breaks-the-chain",
        ),
        pytest.param(
            [stored([1, 2, 3, 4], PROMPT[:16]), AllBlocksCleared(), stored([5], PROMPT[:4])],
            1,
            id="cleared-then-stored",
        ),
        pytest.param(
            [stored([b"\x01" * 32], PROMPT[:4]), stored([b"\x02" * 32], PROMPT[4:8], b"\x01" * 32)],
            2,
            id="bytes-hashes",
        ),
        pytest.param([stored([1], [9, 9, 9, 9]), stored([2], PROMPT[4:8], 1)], 0, id="other-text"),
    ],
)
def test_matched_blocks_follow_store_remove_clear(events: list[Any], expected_blocks: int) -> None:
    index = index_with(*events)
    assert index.matched_blocks("a", PROMPT) == expected_blocks


def test_engine_hashes_do_not_matter_only_the_tokens() -> None:
    index = PreciseIndex()
    # two engines with different hash seeds store the same prompt
    index.apply("a", batch(stored([11, 12], PROMPT[:8])))
    index.apply("b", batch(stored([98765, 43210], PROMPT[:8])))
    assert index.matched_blocks("a", PROMPT) == index.matched_blocks("b", PROMPT) == 2


def test_own_keys_are_the_shared_chained_hashes() -> None:
    index = index_with(stored([1, 2], PROMPT[:8]))
    keys = token_block_hashes(PROMPT, BS, lora_seed(None), 10)
    assert index.match(keys, ["a"], now=0.0) == {"a": 2.0}


def test_lora_blocks_only_match_the_same_adapter() -> None:
    index = index_with(stored([1, 2], PROMPT[:8], lora="a1"))
    assert index.matched_blocks("a", PROMPT, "a1") == 2
    assert index.matched_blocks("a", PROMPT, None) == 0
    assert index.matched_blocks("a", PROMPT, "a2") == 0


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        # 3 blocks on GPU → 1 + 1 + 1
        pytest.param([stored([1, 2, 3], PROMPT[:12])], 3.0, id="gpu"),
        # 3 blocks offloaded to CPU → 0.8 each
        pytest.param([stored([1, 2, 3], PROMPT[:12], medium="CPU")], 2.4, id="cpu"),
        # GPU then the same blocks also on CPU: the best tier counts
        pytest.param(
            [stored([1, 2, 3], PROMPT[:12]), stored([1, 2, 3], PROMPT[:12], medium="CPU")],
            3.0,
            id="both-tiers",
        ),
        # on both, then evicted from GPU: 0.8 each
        pytest.param(
            [
                stored([1, 2, 3], PROMPT[:12]),
                stored([1, 2, 3], PROMPT[:12], medium="CPU"),
                BlockRemoved([1, 2, 3], "GPU"),
            ],
            2.4,
            id="gpu-evicted-cpu-kept",
        ),
        # GPU block 1, block 2 only on CPU: 1 + 0.8
        pytest.param(
            [
                stored([1, 2], PROMPT[:8]),
                BlockRemoved([2], "GPU"),
                stored([2], PROMPT[4:8], 1, "CPU"),
            ],
            1.8,
            id="mixed-chain",
        ),
    ],
)
def test_tiers_are_weighted(events: list[Any], expected: float) -> None:
    index = index_with(*events)
    keys = token_block_hashes(PROMPT, BS, lora_seed(None), 10)
    assert index.match(keys, ["a"], now=0.0)["a"] == pytest.approx(expected)


def test_offloaded_blocks_may_arrive_before_their_parent_in_a_batch() -> None:
    """vLLM's `OffloadingEventsTracker` publishes one self-contained `BlockStored` per
    offloaded chunk (its own parent hash) in whatever order the CPU manager completed
    them ("key order is free"). When the GPU evicted the chain before the copy finished,
    a child's CPU store can come before its parent's (seen from vLLM 0.32's scheduler
    in tests/engine/test_offload_events.py): the index must still link it."""
    index = index_with(
        stored([1, 2, 3], PROMPT[:12]),
        BlockRemoved([1, 2, 3], "GPU"),
    )
    index.apply(
        "a",
        batch(
            stored([3], PROMPT[8:12], 2, "CPU"),
            stored([1], PROMPT[:4], None, "CPU"),
            stored([2], PROMPT[4:8], 1, "CPU"),
        ),
    )
    assert index.tier_blocks("a", PROMPT, "cpu") == 3
    assert index.stats.unknown_parent == 0
    keys = token_block_hashes(PROMPT, BS, lora_seed(None), 10)
    assert index.match(keys, ["a"], now=0.0)["a"] == pytest.approx(2.4)


def test_a_store_whose_parent_never_comes_is_still_dropped() -> None:
    index = index_with(stored([3], PROMPT[8:12], 2, "CPU"), stored([9], PROMPT[:4], None, "CPU"))
    assert index.blocks("a") == 1 and index.stats.unknown_parent == 1


def test_a_waiting_store_removed_later_in_the_batch_is_not_revived() -> None:
    index = index_with(
        stored([2], PROMPT[4:8], 1, "CPU"),
        BlockRemoved([2], "CPU"),
        stored([1], PROMPT[:4], None, "CPU"),
    )
    assert index.tier_blocks("a", PROMPT, "cpu") == 1 and index.blocks("a") == 1


def test_memory_is_bounded_per_endpoint_least_recently_stored_first() -> None:
    index = PreciseIndex(max_blocks_per_endpoint=3)
    index.apply("a", batch(stored([1, 2, 3, 4], PROMPT[:16])))
    # block 1 (the oldest) went, so nothing matches from the start any more
    assert index.sizes() == {"a": 3}
    assert index.stats.evicted_blocks == 1
    assert index.matched_blocks("a", PROMPT) == 0


def test_clear_forgets_one_endpoint_only() -> None:
    index = PreciseIndex()
    for address in ("a", "b"):
        index.apply(address, batch(stored([1, 2], PROMPT[:8])))
    index.clear("a")
    assert index.sizes() == {"b": 2}
    assert index.matched_blocks("b", PROMPT) == 2
    assert index._holders and all(set(h) == {"b"} for h in index._holders.values())


def test_removing_everything_leaves_no_holders_behind() -> None:
    index = index_with(stored([1, 2, 3, 4], PROMPT[:16]), BlockRemoved([1, 2, 3, 4], "GPU"))
    assert index.sizes() == {"a": 0}
    assert index._holders == {}


@pytest.mark.parametrize(
    ("tokens", "cached_blocks", "expected"),
    [
        # 18 tokens, all 4 full blocks cached: the engine hits 4 x 4 = 16 (the last token is
        # always computed, and 17 // 4 x 4 = 16)
        pytest.param(PROMPT, 4, 16, id="all-blocks"),
        # 16 tokens, 4 blocks cached: (16 - 1) // 4 x 4 = 12, never the last token
        pytest.param(PROMPT[:16], 4, 12, id="exact-multiple-leaves-last-token"),
        pytest.param(PROMPT, 2, 8, id="two-blocks"),
    ],
)
def test_predicted_hit_tokens_like_vllm(
    tokens: list[int], cached_blocks: int, expected: int
) -> None:
    hashes = list(range(1, cached_blocks + 1))
    index = index_with(stored(hashes, PROMPT[: cached_blocks * BS]))
    assert index.predicted_hit_tokens("a", tokens) == expected


def test_the_real_vllm_batches_predict_the_recorded_prompts() -> None:
    entries = json.loads((FIXTURES / "index.json").read_text())
    index = PreciseIndex()
    predictions = []
    for entry in entries:
        decoded = decode_batch((FIXTURES / entry["frames"][2]).read_bytes())
        index.apply("vllm", decoded)
        prompt = entry.get("prompt_token_ids")
        if prompt:
            lora = "a1" if entry["phase"].startswith("lora") else None
            predictions.append(
                (entry["seq"], len(prompt), index.predicted_hit_tokens("vllm", prompt, lora))
            )
    # after each prompt's own BlockStored, the same prompt again hits
    # floor((n - 1) / 32) * 32 of its n tokens: 108 → 96, 79 → 64, 53 → 32
    assert predictions == [(0, 108, 96), (1, 108, 96), (2, 79, 64), (9, 53, 32)]
    first = entries[0]["prompt_token_ids"]
    # seq 7 evicted the first prompt's blocks: nothing of it is left
    assert index.predicted_hit_tokens("vllm", first) == 0
    # the adapter prompt's blocks were also evicted (seq 7), and the reset cleared the rest
    assert index.sizes() == {"vllm": 1}


# -- the scorer -------------------------------------------------------------------------


def state(address: str, block_size: int | None = None) -> EndpointState:
    s = EndpointState(Endpoint(address=address, url=f"http://{address}"))
    s.metrics.block_size = block_size
    return s


def request(tokens: list[int] | None, lora: str | None = None) -> LLMRequest:
    r = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", lora=lora, prompt="x" * 40)
    if tokens is not None:
        r.cache["token_ids"] = tokens
    return r


def scorer(**params: Any) -> PrecisePrefixCacheScorer:
    return PrecisePrefixCacheScorer.from_config("p", params, PluginContext())


CYCLE = CycleState(now=100.0, rng=random.Random(0))


def test_score_is_weighted_matched_blocks_over_prompt_blocks() -> None:
    s = scorer()
    s.index.apply("a:1", batch(stored([1, 2, 3], PROMPT[:12])))
    s.index.apply("b:1", batch(stored([4], PROMPT[:4], medium="CPU")))
    eps = [state("a:1"), state("b:1"), state("c:1")]
    # 18 tokens / block 4 = 4 prompt blocks; a holds 3 → 3/4; b holds 1 on CPU → 0.8/4
    assert s.score(CYCLE, request(PROMPT), eps) == [0.75, 0.2, 0.0]


def test_without_token_ids_or_events_the_scorer_contributes_nothing() -> None:
    s = scorer()
    eps = [state("a:1"), state("b:1")]
    assert s.score(CYCLE, request(None), eps) == [0.0, 0.0]
    assert s.score(CYCLE, request(PROMPT), eps) == [0.0, 0.0]


def test_block_size_comes_from_events_then_metrics_then_parameter() -> None:
    s = scorer(tokenProcessorConfig={"blockSize": 8})
    s.index.apply("a:1", batch(stored([1], PROMPT[:4])))
    assert s._block_size(state("a:1", block_size=16)) == BS
    assert s._block_size(state("b:1", block_size=16)) == 16
    assert s._block_size(state("c:1")) == 8


def test_keys_are_computed_once_per_block_size_and_cached_on_the_request() -> None:
    s = scorer()
    r = request(PROMPT)
    first = s.block_keys(r, BS)
    assert s.block_keys(r, BS) is first
    assert first == token_block_hashes(PROMPT, BS, lora_seed(None), 100)


def test_speculative_entries_count_until_their_ttl() -> None:
    s = scorer(speculativeIndexing=True, speculativeTTL="2s")
    a, b = state("a:1", BS), state("b:1", BS)
    r = request(PROMPT)
    s.pre_request(r, Decision(endpoint=a, fallbacks=[b]), now=100.0)
    assert s.score(CycleState(101.0, random.Random(0)), request(PROMPT), [a, b]) == [1.0, 0.0]
    assert s.score(CycleState(102.5, random.Random(0)), request(PROMPT), [a, b]) == [0.0, 0.0]
    s.index.expire(102.5)
    assert s.index.speculative_entries == 0


def test_without_speculative_indexing_pre_request_adds_nothing() -> None:
    s = scorer()
    a = state("a:1", BS)
    s.pre_request(request(PROMPT), Decision(endpoint=a, fallbacks=[]), now=100.0)
    assert s.index.speculative_entries == 0


def test_llm_d_parameters_are_accepted() -> None:
    s = scorer(
        tokenProcessorConfig={"blockSize": 64, "hashSeed": "42"},
        indexerConfig={
            "kvBlockIndexConfig": {
                "inMemoryConfig": {"size": 1000, "podCacheSize": 4},
                "enableMetrics": True,
            },
            "kvCacheBackendConfigs": [
                {"name": "gpu", "weight": 1.0},
                {"name": "cpu", "weight": 0.5},
            ],
            "tokenizersPoolConfig": {"modelName": "x"},
        },
        kvEventsConfig={
            "topicFilter": "kv@",
            "concurrency": 8,
            "discoverPods": True,
            "podDiscoveryConfig": {"socketPort": 5600},
        },
        speculativeIndexing=True,
        speculativeTTL="500ms",
    )
    assert (s.default_block_size, s.speculative_ttl) == (64, 0.5)
    s.index.apply("a", batch(stored([1], PROMPT[:4], medium="CPU")))
    keys = token_block_hashes(PROMPT, BS, lora_seed(None), 1)
    assert s.index.match(keys, ["a"], 0.0) == {"a": 0.5}


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        pytest.param({"blockSize": 16}, "unknown parameter 'blockSize'", id="flat-block-size"),
        pytest.param({"speculativeTTL": "soon"}, "positive duration", id="bad-ttl"),
        pytest.param({"tokenProcessorConfig": {"blockSize": 0}}, "greater than or equal", id="bs0"),
        pytest.param(
            {"indexerConfig": {"kvCacheBackendConfigs": [{"name": "gpu", "weight": 2}]}},
            "less than or equal to 1",
            id="weight-over-1",
        ),
        pytest.param({"kvEventsConfig": {"engineType": "trt"}}, "vllm or sglang", id="engine"),
    ],
)
def test_bad_parameters_are_load_errors(params: dict[str, Any], problem: str) -> None:
    with pytest.raises(PluginParameterError) as info:
        PrecisePrefixCacheScorer.from_config("p", params, PluginContext())
    assert problem in str(info.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2s", 2.0), ("500ms", 0.5), ("1m30s", 90.0), ("1h", 3600.0), ("0.25s", 0.25)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "2", "s2", "2s junk"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("pool", "params", "expected"),
    [
        pytest.param(
            KVEventsSettings(port=5557, replay_port=5558),
            {},
            ChosenKVEvents(KVEventsSettings(port=5557, replay_port=5558), auto=False),
            id="pool-port",
        ),
        pytest.param(
            KVEventsSettings(),
            {"kvEventsConfig": {"discoverPods": True, "podDiscoveryConfig": {"socketPort": 6000}}},
            ChosenKVEvents(KVEventsSettings(port=6000, topic_filter="kv@"), auto=False),
            id="llm-d-discover-pods",
        ),
        pytest.param(
            KVEventsSettings(),
            {"kvEventsConfig": {"zmqEndpoint": "tcp://*:5557"}},
            # taken as given, unauthenticated: the manager keeps bind mode off and says why
            ChosenKVEvents(
                KVEventsSettings(topic_filter="kv@").model_copy(update={"bind": "tcp://*:5557"}),
                auto=False,
            ),
            id="llm-d-global-socket",
        ),
        pytest.param(
            KVEventsSettings(),
            {},
            ChosenKVEvents(
                KVEventsSettings(port=5557, replay_port=5558), auto=True, replay_optional=True
            ),
            id="nothing-configured-llm-d-convention",
        ),
    ],
)
def test_transport_settings(
    pool: KVEventsSettings, params: dict[str, Any], expected: ChosenKVEvents
) -> None:
    assert kv_events_settings({"p": scorer(**params)}, pool) == expected


def test_parameters_model_defaults() -> None:
    p = PrecisePrefixParameters.model_validate({})
    assert (p.speculative_indexing, p.speculative_ttl, p.max_blocks_per_endpoint) == (
        False,
        "2s",
        131072,
    )
