"""servegate's precise prefix routing against real vLLM: tokenizer ids and index predictions.

`HFTokenizer` (the pool's `tokenizer: {source: hf}`) must give exactly the ids the
engine computes, for completion prompts (with BOS) and for chats (the folder's chat
template). servegate's precise index, fed only by the server's KV events (decoded
by servegate's decoder, sequenced by its `KVEventStream`), must predict the prefix
hits the engine then reports in `vllm:prefix_cache_hits_total`: the acceptance
"within one block" is checked exactly here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from test_kv_events import BLOCK, complete, prompt

from servegate.datalayer.kvevents import EventBatch, KVEventStream, SubscriberStats
from servegate.scheduling.prefix.precise import PreciseIndex
from servegate.testing.tinymodel import TinyModel
from servegate.testing.vllm_cluster import VllmCluster, VllmServer
from servegate.tokenization.sources import HFTokenizer

ADDRESS = "replica"


class _Sink:
    def __init__(self, index: PreciseIndex) -> None:
        self.index = index

    def apply(self, topic: bytes, batch: EventBatch) -> None:
        self.index.apply(ADDRESS, batch)

    def reset(self, topic: bytes) -> None:
        self.index.clear(ADDRESS)


class IndexFeeder:
    """A SUB socket in a thread feeding servegate's stream and index."""

    def __init__(self, server: VllmServer) -> None:
        self.index = PreciseIndex()
        self.stats = SubscriberStats()
        self.stream = KVEventStream(_Sink(self.index), self.stats, can_replay=False)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(server.kv_connect)
        self._thread = threading.Thread(target=self._run, name="precise-index-feeder")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            with self.lock:
                self.stream.on_message(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._context.term()

    def predicted(self, tokens: list[int], lora: str | None) -> int:
        with self.lock:
            return self.index.predicted_hit_tokens(ADDRESS, tokens, lora)

    def settle(self, tokens: list[int], lora: str | None, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        want = len(tokens) // BLOCK
        while True:
            with self.lock:
                if self.index.matched_blocks(ADDRESS, tokens, lora) >= want:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"the index never held the prompt's {want} blocks")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def feeder(cluster: VllmCluster) -> Iterator[IndexFeeder]:
    server = cluster[0]
    feed = IndexFeeder(server)
    try:
        for attempt in range(20):  # slow joiner: prompts until a batch arrives
            complete(server, prompt(f"precise-join-{attempt}", 40))
            time.sleep(0.3)
            if feed.stats.batches:
                break
        assert feed.stats.batches, "no KV events reached servegate's stream"
        yield feed
    finally:
        feed.close()
    assert feed.stats.dropped == {}, feed.stats.dropped


CHATS = [
    [{"role": "user", "content": "hello router"}],
    [
        {"role": "system", "content": prompt("system", 60)},
        {"role": "user", "content": "which replica holds the prefix?"},
    ],
]


@pytest.mark.parametrize("text", [prompt("hf-a", 30), prompt("hf-b", 200), "x"])
def test_hf_completion_ids_equal_vllms(
    cluster: VllmCluster, tiny_model: TinyModel, text: str
) -> None:
    tok = HFTokenizer(str(tiny_model.model_dir))
    assert tok.completion_ids(text, True) == cluster[0].tokenize(text)


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "system-and-user"])
def test_hf_chat_ids_equal_vllms(
    cluster: VllmCluster, tiny_model: TinyModel, messages: list[dict[str, str]]
) -> None:
    tok = HFTokenizer(str(tiny_model.model_dir))
    answer = cluster[0].post(
        "/tokenize", {"model": "tiny", "messages": messages, "add_generation_prompt": True}
    )
    assert tok.chat_ids(messages, {}) == answer["tokens"]


def test_the_precise_index_predicts_vllms_prefix_hits(
    cluster: VllmCluster, feeder: IndexFeeder
) -> None:
    server = cluster[0]
    base = prompt("precise-hits", 150)
    words = base.split()
    probes = [
        ("cold", base, "tiny"),
        ("repeat", base, "tiny"),
        (
            "shared-two-thirds",
            " ".join(words[: len(words) * 2 // 3] + prompt("y", 40).split()),
            "tiny",
        ),
        ("other-cold", prompt("precise-cold", 100), "tiny"),
        ("adapter-does-not-share-base-blocks", base, "a1"),
        ("adapter-repeat", base, "a1"),
    ]
    results = []
    for name, text, model in probes:
        lora = None if model == "tiny" else model
        tokens = server.tokenize(text, model=model)
        predicted = feeder.predicted(tokens, lora)
        actual = complete(server, text, model=model)
        results.append((name, predicted, actual))
        feeder.settle(tokens, lora)
    assert [(n, p) for n, p, _ in results] == [(n, a) for n, _, a in results]
    by_name = {n: p for n, p, _ in results}
    assert by_name["cold"] == 0 and by_name["adapter-does-not-share-base-blocks"] == 0
    assert by_name["repeat"] > by_name["shared-two-thirds"] > 0
    assert by_name["adapter-repeat"] == by_name["repeat"]
