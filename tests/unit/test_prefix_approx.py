import random
from collections import OrderedDict
from itertools import takewhile

import pytest

from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.approx import (
    ApproxPrefixIndex,
    ApproxPrefixParameters,
    PrefixCacheScorer,
)
from servegate.scheduling.prefix.hashing import (
    RecentChains,
    chain_seed,
    char_block_hashes,
    token_block_hashes,
)
from servegate.scheduling.request import LLMRequest, RequestKind


def state(address: str, **metrics: float) -> EndpointState:
    return EndpointState(
        endpoint=Endpoint(address=address, url=f"http://{address}"),
        metrics=EndpointMetrics(**metrics),  # type: ignore[arg-type]
        healthy=True,
    )


def request(prompt: str, model: str = "m", lora: str | None = None) -> LLMRequest:
    return LLMRequest(
        request_id="r",
        kind=RequestKind.COMPLETION,
        model=model,
        target_model=model,
        base_model=model,
        lora=lora,
        prompt=prompt,
    )


def cycle() -> CycleState:
    return CycleState(now=0.0, rng=random.Random(0))


def test_char_hashes_chain_and_drop_partial_block() -> None:
    seed = chain_seed("m")
    a = char_block_hashes("a" * 10, 4, seed, 100)
    assert len(a) == 2  # 10 // 4 full blocks; the trailing 2 characters have no key
    b = char_block_hashes("a" * 8 + "b" * 4, 4, seed, 100)
    assert a == b[:2]  # same prefix, same keys
    assert b[2] != b[1]
    assert len(char_block_hashes("a" * 100, 4, seed, 5)) == 5  # maxPrefixBlocksToMatch


@pytest.mark.parametrize("limit", [1, 3, 256], ids=["limit-1", "limit-3", "limit-256"])
def test_recent_chains_give_the_keys_char_block_hashes_gives(limit: int) -> None:
    rng = random.Random(limit)
    recent = RecentChains(4, 12, limit)
    seeds = [chain_seed("m"), chain_seed("n"), chain_seed("m", "a1")]
    sent: list[str] = []
    for _ in range(3000):
        shape = rng.randrange(6)
        if sent and shape == 0:  # sent again
            text = rng.choice(sent)
        elif sent and shape == 1:  # the next turn: the last prompt plus more
            text = rng.choice(sent) + "".join(rng.choices("abé", k=rng.randrange(9)))
        elif sent and shape == 2:  # a leading part of one
            old = rng.choice(sent)
            text = old[: rng.randrange(len(old) + 1)]
        elif sent and shape == 3:  # the same start, then a change somewhere
            old = rng.choice(sent)
            cut = rng.randrange(len(old) + 1)
            text = old[:cut] + rng.choice("xyé") + old[cut + 1 :]
        else:  # a new prompt (short alphabet: shared first blocks are common)
            text = "".join(rng.choices("ab", k=rng.randrange(60)))
        sent.append(text)
        seed = rng.choice(seeds)
        # (max 12 blocks: prompts longer than 48 bytes are cut, as maxPrefixBlocksToMatch does)
        assert recent.keys(text, seed) == char_block_hashes(text, 4, seed, 12), text


def test_seed_separates_models_and_adapters() -> None:
    keys = {
        tuple(char_block_hashes("x" * 8, 4, chain_seed(model, lora), 9))
        for model, lora in [("m", None), ("n", None), ("m", "a1")]
    }
    assert len(keys) == 3


def test_token_hashes_match_on_common_prefix() -> None:
    seed = chain_seed("m")
    a = token_block_hashes([1, 2, 3, 4, 5, 6, 7], 2, seed, 9)
    b = token_block_hashes([1, 2, 3, 4, 9, 9], 2, seed, 9)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]


def test_the_index_evicts_the_least_recently_used_block() -> None:
    index = ApproxPrefixIndex(2)
    index.insert("a", [1, 2])
    index.insert("a", [1])  # refresh 1 → 2 is now the oldest
    index.insert("a", [3])
    assert index.holds(1) and not index.holds(2) and index.holds(3)
    assert len(index) == 2


def test_a_held_chain_inserted_again_is_refreshed_not_duplicated() -> None:
    index = ApproxPrefixIndex(3)
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.insert("a", [1, 2, 3])  # held: refreshed in order, 1 stays the oldest of a's
    index.insert("a", [4])  # a evicts 1; b still holds it
    assert index.match_lengths([1, 2], ["a", "b"]) == {"a": 0, "b": 2}
    assert index.match_lengths([2, 3, 4], ["a", "b"]) == {"a": 3, "b": 1}
    index.remove_server("b")
    assert not index.holds(1) and len(index) == 3


def test_index_match_lengths_are_leading_runs() -> None:
    index = ApproxPrefixIndex(100)
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.insert("c", [2, 3])  # holds later blocks but not the first: no leading match
    assert index.match_lengths([1, 2, 3, 4], ["a", "b", "c", "d"]) == {
        "a": 3,
        "b": 2,
        "c": 0,
        "d": 0,
    }


class LruModel:
    """Each replica's LRU of block keys, modelled one replica at a time: what the index
    must agree with."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lrus: dict[str, OrderedDict[int, None]] = {}

    def insert(self, address: str, chain: list[int]) -> None:
        lru = self.lrus.setdefault(address, OrderedDict())
        for key in chain:
            lru.pop(key, None)
            lru[key] = None
            while len(lru) > self.capacity:
                lru.popitem(last=False)

    def held(self, address: str, chain: list[int]) -> int:
        """The run of leading blocks of `chain` the replica still holds."""
        return len(list(takewhile(self.lrus.get(address, {}).__contains__, chain)))


def random_chains(rng: random.Random, stems: int, longest: int, count: int) -> list[list[int]]:
    """Chains sharing prefixes (cut from a few stems), each ending in a key of its own."""
    roots = [[rng.getrandbits(64) for _ in range(rng.randint(1, longest))] for _ in range(stems)]
    return [
        [*rng.choice(roots)[: rng.randint(1, longest)], rng.getrandbits(64)] for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(8))
def test_match_lengths_follow_each_replicas_lru(seed: int) -> None:
    """Random chains sharing prefixes, recorded on random replicas with small LRUs (so
    blocks are evicted from the middle of chains too): each replica's match is the run
    of leading blocks its own LRU, modelled here one replica at a time, still holds."""
    rng = random.Random(seed)
    capacity = rng.randint(8, 40)
    index = ApproxPrefixIndex(capacity)
    model = LruModel(capacity)
    chains = random_chains(rng, stems=4, longest=20, count=30)
    addresses = [f"r{i}" for i in range(12)]
    for _ in range(200):
        address, chain = rng.choice(addresses), rng.choice(chains)
        index.insert(address, chain)
        model.insert(address, chain)
    for chain in chains:
        asked = rng.sample(addresses, rng.randint(1, len(addresses)))
        expected = {a: model.held(a, chain) for a in asked}
        assert index.match_lengths(chain, asked) == expected


def test_a_chain_sent_again_matches_whole_until_its_blocks_may_be_gone() -> None:
    index = ApproxPrefixIndex(4)
    index.insert("a", [1, 2])
    index.insert("a", [3])  # nothing evicted yet
    lru = index._servers["a"]  # the shortcut itself, asked directly
    assert lru.holds_whole([1, 2]) and index.match_lengths([1, 2], ["a"]) == {"a": 2}
    assert not lru.holds_whole([1, 9, 2])  # not a chain inserted whole: walked
    index.insert("a", [4, 5])  # evicts 1, the chain's oldest block
    assert not lru.holds_whole([1, 2]) and index.match_lengths([1, 2], ["a"]) == {"a": 0}


def test_a_hash_chain_is_known_by_its_last_key_and_length() -> None:
    index = ApproxPrefixIndex(8)
    index.insert("a", [1, 2, 3], chained=True)
    lru = index._servers["a"]
    assert lru.holds_whole([1, 2, 3], chained=True)
    assert not lru.holds_whole([2, 3], chained=True)  # another length: another chain
    assert not lru.holds_whole([1, 2, 3])  # not said to be a chain: no keys kept to compare
    assert index.match_lengths([1, 2, 3], ["a"]) == {"a": 3}  # walked instead


def test_the_next_turn_of_a_conversation_matches_the_chain_sent_before() -> None:
    index = ApproxPrefixIndex(16)
    index.insert("a", [1, 2, 3], chained=True)
    index.insert("b", [1, 2], chained=True)
    lru = index._servers["a"]
    assert lru.holds_whole([1, 2, 3, 4, 5], chained=True, length=3)
    assert index.match_lengths([1, 2, 3, 4, 5], ["a", "b", "c"], chained=True) == {
        "a": 3,  # nobody holds block 4: a's chain is the longest match, without a walk
        "b": 2,  # walked
        "c": 0,
    }
    index.insert("c", [1, 2, 3, 4], chained=True)  # now someone holds block 4
    assert index.match_lengths([1, 2, 3, 4, 5], ["a", "b", "c"], chained=True) == {
        "a": 3,
        "b": 2,
        "c": 4,
    }


def test_a_block_evicted_from_the_middle_of_a_recorded_chain_is_seen() -> None:
    index = ApproxPrefixIndex(4)
    index.insert("a", [1, 2, 3])
    index.insert("a", [1])  # refresh 1: 2 is now the oldest
    index.insert("a", [4, 5])  # evicts 2 from the middle of [1, 2, 3]
    assert not index._servers["a"].holds_whole([1, 2, 3])
    assert index.match_lengths([1, 2, 3], ["a"]) == {"a": 1}


def test_a_recorded_chain_survives_evictions_of_older_blocks() -> None:
    index = ApproxPrefixIndex(5)
    index.insert("a", [7, 8, 9])
    index.insert("a", [1, 2])  # [7 8 9 1 2]: three blocks older than the chain [1, 2]
    lru = index._servers["a"]
    index.insert("a", [3, 4])  # evicts 7 and 8
    index.insert("a", [5])  # evicts 9: three insertions, the chain's oldest block is next
    assert lru.holds_whole([1, 2]) and index.match_lengths([1, 2], ["a"]) == {"a": 2}
    index.insert("a", [6])  # evicts 1
    assert not lru.holds_whole([1, 2]) and index.match_lengths([1, 2], ["a"]) == {"a": 0}


def test_a_chain_too_long_to_record_still_voids_the_chains_it_evicts() -> None:
    index = ApproxPrefixIndex(4)
    index.insert("a", [1, 2])
    index.insert("a", [3, 4, 5, 6, 7])  # longer than the LRU: not recorded; evicts 1, 2, 3
    assert not index._servers["a"].holds_whole([1, 2])
    assert index.match_lengths([1, 2], ["a"]) == {"a": 0}


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_match_lengths_between_insertions_follow_each_replicas_lru(
    seed: int, chained: bool
) -> None:
    """As above, but matching every chain after each insertion, so that chains recorded
    whole are asked about at every point of their eviction (the shortcut must never
    claim a block an LRU no longer holds); some answers must come from the shortcut.
    Each chain ends in a key of its own, so its last key stands for it (`chained`)."""
    rng = random.Random(seed)
    capacity = rng.randint(6, 16)
    index = ApproxPrefixIndex(capacity)
    model = LruModel(capacity)
    chains = random_chains(rng, stems=3, longest=8, count=10)
    addresses = [f"r{i}" for i in range(3)]
    whole = 0
    for _ in range(300):
        address, chain = rng.choice(addresses), rng.choice(chains)
        index.insert(address, list(chain), chained=chained)  # a copy, as a request's own
        model.insert(address, chain)
        for chain_asked in chains:
            for asked in (chain_asked, [*chain_asked, rng.getrandbits(64)]):  # the next turn
                expected = {a: model.held(a, asked) for a in addresses}
                assert index.match_lengths(list(asked), addresses, chained=chained) == expected
            servers = index._servers
            whole += sum(
                1
                for a in addresses
                if a in servers and servers[a].holds_whole(chain_asked, chained)
            )
    assert whole > 0


def test_index_eviction_updates_reverse_map() -> None:
    index = ApproxPrefixIndex(2)
    index.insert("a", [1, 2, 3])  # capacity 2: key 1 evicted
    assert index.match_lengths([1], ["a"]) == {"a": 0}
    assert index.match_lengths([1, 2, 3], ["a"]) == {"a": 0}  # the leading block is gone
    assert index.match_lengths([2, 3], ["a"]) == {"a": 2}
    assert len(index) == 2
    index.remove_server("a")
    assert len(index) == 0 and index.match_lengths([2], ["a"]) == {"a": 0}


@pytest.mark.parametrize(
    ("sent", "asked", "expected"),
    [
        # 64-char blocks (16 tokens × 4): 256 chars = 4 blocks
        pytest.param("s" * 256, "s" * 256, 1.0, id="same-prompt"),
        pytest.param("s" * 128 + "x" * 128, "s" * 128 + "y" * 128, 0.5, id="half"),  # 2 of 4
        pytest.param("s" * 256, "t" * 256, 0.0, id="different"),
    ],
)
def test_scorer_after_dispatch(sent: str, asked: str, expected: float) -> None:
    scorer = PrefixCacheScorer("p", ApproxPrefixParameters())
    a, b = state("a:1"), state("b:1")
    first = request(sent)
    scorer.pre_request(first, Decision(endpoint=a, fallbacks=[b]), 0.0)
    scores = scorer.score(cycle(), request(asked), [a, b])
    assert list(scores) == [expected, 0.0]


def test_prompt_shorter_than_a_block_scores_zero() -> None:
    scorer = PrefixCacheScorer("p", ApproxPrefixParameters())
    assert list(scorer.score(cycle(), request("short"), [state("a:1")])) == [0.0]


def test_token_ids_use_token_blocks() -> None:
    scorer = PrefixCacheScorer("p", ApproxPrefixParameters.model_validate({"blockSizeTokens": 2}))
    a = state("a:1")
    sent = request("")
    sent.cache["token_ids"] = [1, 2, 3, 4]
    scorer.pre_request(sent, Decision(endpoint=a, fallbacks=[]), 0.0)
    asked = request("")
    asked.cache["token_ids"] = [1, 2, 7, 7]
    assert list(scorer.score(cycle(), asked, [a])) == [0.5]  # 1 of 2 token blocks


def test_auto_tune_capacity_from_cache_geometry() -> None:
    scorer = PrefixCacheScorer("p", ApproxPrefixParameters.model_validate({"blockSizeTokens": 16}))
    small = state("a:1", num_blocks=2, block_size=16)  # 2 × 16 / 16 = 2 blocks of ours
    scorer.pre_request(request("q" * 64 * 3), Decision(endpoint=small, fallbacks=[]), 0.0)
    assert len(scorer.index) == 2


def test_legacy_character_block_size() -> None:
    params = ApproxPrefixParameters.model_validate({"blockSize": 4})
    scorer = PrefixCacheScorer("p", params)
    assert len(scorer.block_keys(request("abcdefgh"))) == 2


def hashed(**params: object) -> PrefixCacheScorer:
    return PrefixCacheScorer("p", ApproxPrefixParameters.model_validate(params))


def test_cold_placement_hash_agrees_across_routers_and_orders() -> None:
    endpoints = [state(f"10.0.0.{i}:8000") for i in range(4)]
    prompt = "system prompt of a new group " * 20
    one, other = hashed(coldPlacement="hash"), hashed(coldPlacement="hash")
    first = one.score(cycle(), request(prompt), endpoints)
    second = other.score(cycle(), request(prompt), endpoints[::-1])
    # exactly one endpoint scores 1.0, and two routers that share nothing pick the same one
    assert sorted(first) == [0.0, 0.0, 0.0, 1.0]
    assert endpoints[list(first).index(1.0)] is endpoints[::-1][list(second).index(1.0)]


def test_cold_placement_hash_spreads_new_prefixes() -> None:
    endpoints = [state(f"10.0.0.{i}:8000") for i in range(4)]
    scorer = hashed(coldPlacement="hash")
    chosen = [
        list(scorer.score(cycle(), request(f"group {g} " * 40), endpoints)).index(1.0)
        for g in range(64)
    ]
    # 64 new prefixes over 4 endpoints: every endpoint gets some (uniform: 16 each)
    assert set(chosen) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("params", "sent", "expected"),
    [
        pytest.param({}, None, [0.0, 0.0], id="default-cold-stays-zero"),
        pytest.param({"coldPlacement": "hash"}, "s" * 256, [1.0, 0.0], id="hash-warm-is-match"),
        pytest.param({"coldPlacement": "none"}, None, [0.0, 0.0], id="none-cold-zero"),
    ],
)
def test_cold_placement_applies_only_when_nothing_matches(
    params: dict[str, object], sent: str | None, expected: list[float]
) -> None:
    scorer = hashed(**params)
    a, b = state("a:1"), state("b:1")
    if sent is not None:
        scorer.pre_request(request(sent), Decision(endpoint=a, fallbacks=[b]), 0.0)
    assert list(scorer.score(cycle(), request("s" * 256), [a, b])) == expected


@pytest.mark.parametrize("seed", range(8))
def test_a_chain_sent_again_to_the_same_replica_leaves_its_lru_as_a_walk_would(
    seed: int,
) -> None:
    """Re-inserting the chain a replica's LRU was last given, with nothing inserted there
    since, skips the walk (its keys are already the newest, in order); each LRU's order,
    and so what later evictions drop, stays that of the per-replica model."""
    rng = random.Random(seed)
    capacity = rng.randint(6, 30)
    index = ApproxPrefixIndex(capacity)
    model = LruModel(capacity)
    chains = random_chains(rng, stems=3, longest=10, count=8)
    addresses = ["r0", "r1"]
    last: dict[str, list[int]] = {}
    for _ in range(300):
        address = rng.choice(addresses)
        chain = last[address] if address in last and rng.random() < 0.6 else rng.choice(chains)
        last[address] = chain
        index.insert(address, list(chain), chained=True)
        model.insert(address, chain)
        for a, lru in index._servers.items():
            assert list(lru.keys) == list(model.lrus[a])
        for asked in chains:
            expected = {a: model.held(a, asked) for a in addresses}
            assert index.match_lengths(list(asked), addresses, chained=True) == expected


@pytest.mark.parametrize("seed", range(6))
def test_the_reverse_map_names_exactly_the_replicas_whose_lru_holds_each_key(seed: int) -> None:
    """Keys held alone share their replica's one frozenset, keys held by several get a set;
    through insertions, evictions and removed replicas the map stays exact."""
    rng = random.Random(seed)
    index = ApproxPrefixIndex(rng.randint(5, 20))
    chains = random_chains(rng, stems=3, longest=8, count=10)
    addresses = [f"r{i}" for i in range(4)]
    for step in range(300):
        if step % 50 == 49:
            index.remove_server(rng.choice(addresses))
        index.insert(rng.choice(addresses), list(rng.choice(chains)), chained=True)
        expected: dict[int, set[str]] = {}
        for address, lru in index._servers.items():
            for key in lru.keys:
                expected.setdefault(key, set()).add(address)
        assert {k: set(v) for k, v in index._where.items()} == expected
    shared = [v for v in index._where.values() if len(v) > 1]
    alone = [v for v in index._where.values() if isinstance(v, frozenset)]
    assert shared and alone
