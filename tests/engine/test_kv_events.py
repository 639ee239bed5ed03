"""Real KV-cache events from vLLM, decoded, and checked against the engine's own counters.

A subscriber per server (started with the session's cluster) collects every batch.
The tests check the wire (3 frames, topic, consecutive sequence numbers), that
`BlockStored` carries exactly the prompt's token ids (from the engine's own
`/tokenize`) in blocks of 32, that adapter blocks carry the adapter, that eviction
and `/reset_prefix_cache` produce `BlockRemoved` / `AllBlocksCleared`, and that an
index built only from the events predicts the prefix-cache hits the engine reports
(`vllm:prefix_cache_hits_total` delta).

Where servegate's precise prefix index goes (the later issue that builds it): add a
test here that feeds the same subscriber's events to it and asserts it predicts the
same hits as `ReferenceIndex` for the prompts below — that is the acceptance
"predicts the cached prompt tokens the engine then reports, within one block".
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import zmq
from inflight import wait_for
from kv_subscriber import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KvSubscriber,
    ReferenceIndex,
)
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.vllm_cluster import VllmCluster, VllmServer

BLOCK = 32
NUM_BLOCKS = 128
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "router",
    "cache",
    "block",
    "token",
    "prefix",
    "replica",
    "engine",
    "queue",
]


@pytest.fixture(scope="module")
def subscribers(cluster: VllmCluster) -> Iterator[list[KvSubscriber]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs = [KvSubscriber(server, context) for server in cluster]
    try:
        for server, sub in zip(cluster, subs, strict=True):
            join(server, sub)
        yield subs
    finally:
        for sub in subs:
            sub.close()
        context.term()
    for sub in subs:
        assert not sub.errors, sub.errors


def join(server: VllmServer, sub: KvSubscriber, attempts: int = 20) -> None:
    """Send fresh one-block prompts until the subscription delivers a message.

    A ZeroMQ subscription takes a moment to reach the publisher; what is published
    before that is dropped for this subscriber (the "slow joiner").
    """
    for attempt in range(attempts):
        mark = sub.mark()
        complete(server, prompt(f"join-{server.index}-{attempt}", 40))
        try:
            sub.wait(mark, lambda ev: len(ev) > 0, timeout_s=1.0)
        except AssertionError:
            continue
        return
    raise AssertionError(f"no KV events from {server.kv_connect} after {attempts} requests")


def prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


def counter(server: VllmServer, family: str) -> float:
    for fam in text_string_to_metric_families(server.metrics_text()):
        if fam.name == family:
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    raise AssertionError(f"{family}_total missing from {server.url}/metrics")


def complete(server: VllmServer, text: str, model: str = "tiny") -> float:
    """Send one prompt; return the prefix-cache hits (tokens) the engine counted for it."""
    tokens = len(server.tokenize(text, model=model))
    queries = counter(server, "vllm:prefix_cache_queries")
    hits = counter(server, "vllm:prefix_cache_hits")
    server.post("/v1/completions", {"model": model, "prompt": text, "max_tokens": 1})
    # the counters move with the engine's next stats record, not with the response
    wait_for(
        lambda: counter(server, "vllm:prefix_cache_queries") >= queries + tokens,
        timeout_s=10,
        what=f"{tokens} prefix-cache queries counted on {server.url}",
    )
    return counter(server, "vllm:prefix_cache_hits") - hits


def stored(events: list[Event]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def chain_tokens(events: list[Event], first: tuple[int, ...]) -> tuple[int, ...]:
    """Token ids along the stored chain that starts with a block equal to `first`."""
    by_parent = {e.parent_block_hash: e for e in stored(events)}
    start = next(e for e in stored(events) if e.token_ids[:BLOCK] == first)
    tokens, event = start.token_ids, start
    while (nxt := by_parent.get(event.block_hashes[-1])) is not None:
        tokens, event = tokens + nxt.token_ids, nxt
    return tokens


@pytest.mark.parametrize("index", [0, 1], ids=["server0", "server1"])
def test_block_stored_carries_the_prompt_tokens(
    cluster: VllmCluster, subscribers: list[KvSubscriber], index: int
) -> None:
    server, sub = cluster[index % len(cluster)], subscribers[index % len(cluster)]
    text = prompt(f"kv-probe-{index}", 120)
    tokens = server.tokenize(text)
    full = len(tokens) // BLOCK * BLOCK
    assert full >= 3 * BLOCK, len(tokens)
    mark = sub.mark()
    complete(server, text)
    events = sub.wait(
        mark, lambda ev: sum(len(e.token_ids) for e in stored(ev)) >= full, timeout_s=10
    )
    messages = sub.since(mark)
    assert all(len(m.frames) == 3 and m.topic == server.topic.encode() for m in messages)
    seqs = [m.seq for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for e in stored(events):
        assert (e.block_size, e.medium, e.lora_name) == (BLOCK, "GPU", None)
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)
    assert chain_tokens(events, tuple(tokens[:BLOCK]))[:full] == tuple(tokens[:full])


def test_adapter_blocks_name_the_adapter(
    cluster: VllmCluster, subscribers: list[KvSubscriber]
) -> None:
    server, sub = cluster[0], subscribers[0]
    text = prompt("kv-lora-a1", 80)
    tokens = server.tokenize(text, model="a1")
    mark = sub.mark()
    complete(server, text, model="a1")
    events = sub.wait(mark, lambda ev: len(stored(ev)) > 0)
    first = [e for e in stored(events) if e.token_ids[:BLOCK] == tuple(tokens[:BLOCK])]
    assert first, events
    assert {(e.lora_name, isinstance(e.lora_id, int)) for e in first} == {("a1", True)}


def settle(
    sub: KvSubscriber,
    mark: int,
    index: ReferenceIndex,
    tokens: list[int],
    lora: str | None = None,
) -> None:
    """Wait for the blocks a prompt must have stored, then feed every new event to `index`."""
    new_blocks = len(tokens) // BLOCK - index.cached_blocks(tokens, lora)
    sub.wait(mark, lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= new_blocks)
    for event in sub.events_since(mark):
        index.apply(event)


def reset(server: VllmServer, sub: KvSubscriber) -> int:
    """Empty the engine's prefix cache; the mark to read the next request's events from.

    vLLM queues `AllBlocksCleared` and publishes it with its next engine step, so it
    arrives in the same batch as, and ahead of, the next request's `BlockStored`.
    """
    mark = sub.mark()
    server.reset_prefix_cache()
    return mark


def test_events_predict_the_engines_prefix_hits(
    cluster: VllmCluster, subscribers: list[KvSubscriber]
) -> None:
    server, sub = cluster[0], subscribers[0]
    index = ReferenceIndex(BLOCK)
    mark = first_mark = reset(server, sub)
    base = prompt("kv-hits", 150)
    words = base.split()
    probes = [
        ("cold", base),
        ("repeat", base),
        ("shared-two-thirds", " ".join(words[: len(words) * 2 // 3] + prompt("x", 40).split())),
        ("other-cold", prompt("kv-cold", 100)),
        ("adapter-does-not-share-base-blocks", base),
    ]
    predictions = []
    for name, text in probes:
        model = "a1" if name.startswith("adapter") else "tiny"
        lora = "a1" if model == "a1" else None
        tokens = server.tokenize(text, model=model)
        predicted = index.predicted_hit_tokens(tokens, lora)
        actual = complete(server, text, model=model)
        predictions.append((name, predicted, actual))
        settle(sub, mark, index, tokens, lora)
        mark = sub.mark()
    assert isinstance(sub.events_since(first_mark)[0], AllBlocksCleared)
    assert [(n, p) for n, p, _ in predictions] == [(n, a) for n, _, a in predictions]
    # cold 0; repeat all full blocks but never the last token; shared part only; cold 0
    assert predictions[0][1] == 0 and predictions[1][1] > 3 * BLOCK
    assert 0 < predictions[2][1] < predictions[1][1]
    assert predictions[3][1] == 0 and predictions[4][1] == 0


def test_eviction_removes_blocks_and_the_index_follows(
    cluster: VllmCluster, subscribers: list[KvSubscriber]
) -> None:
    server, sub = cluster[-1], subscribers[-1]
    index = ReferenceIndex(BLOCK)
    mark = step = reset(server, sub)
    # 6 prompts of ~28 blocks each need ~170 blocks; the cache holds 128.
    texts = [prompt(f"kv-evict-{i}", 900) for i in range(6)]
    first_tokens = server.tokenize(texts[0])
    assert len(first_tokens) >= 25 * BLOCK, len(first_tokens)
    for text in texts:
        complete(server, text)
        settle(sub, step, index, server.tokenize(text))
        step = sub.mark()
    events = sub.events_since(mark)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    ever_stored = {h for e in stored(events) for h in e.block_hashes}
    assert removed, "no BlockRemoved although the prompts need more blocks than the cache has"
    assert removed <= ever_stored
    assert len(ever_stored - removed) <= NUM_BLOCKS
    predicted = index.predicted_hit_tokens(first_tokens)
    assert predicted < (len(first_tokens) - 1) // BLOCK * BLOCK  # the first prompt was evicted
    assert complete(server, texts[0]) == predicted
