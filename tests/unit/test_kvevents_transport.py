"""Frames, sequence numbers, gaps and replay; real ZeroMQ sockets on loopback/ipc."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from servegate.datalayer.kvevents import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEventStream,
    KVEventSubscriber,
    SubscriberStats,
)
from servegate.datalayer.kvevents.transport import parse_replay_frames
from servegate.simulator import kv_cache
from servegate.simulator.kv_events import ZmqEventPublisher

FIXTURES = Path(__file__).parents[1] / "fixtures" / "real" / "kv_events"
END = (-1).to_bytes(8, "big", signed=True)


class Sink:
    def __init__(self) -> None:
        self.batches: list[tuple[bytes, EventBatch]] = []
        self.resets: list[bytes] = []

    def apply(self, topic: bytes, batch: EventBatch) -> None:
        self.batches.append((topic, batch))

    def reset(self, topic: bytes) -> None:
        self.resets.append(topic)

    def timestamps(self) -> list[float]:
        return [b.ts for _, b in self.batches]


def payload(ts: float, events: list[Any] | None = None) -> bytes:
    return msgpack.packb([ts, events or [], 0], use_bin_type=True)  # type: ignore[no-any-return]


def frames(seq: int, ts: float | None = None, topic: bytes = b"kv@a@m") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(float(seq) if ts is None else ts)]


def stream(can_replay: bool = False) -> tuple[KVEventStream, Sink]:
    sink = Sink()
    return KVEventStream(sink, SubscriberStats(), can_replay=can_replay), sink


@pytest.mark.parametrize(
    ("seqs", "applied", "missed", "gaps", "restarts"),
    [
        pytest.param([0, 1, 2], [0, 1, 2], 0, 0, 0, id="consecutive"),
        pytest.param([5, 6], [5, 6], 0, 0, 0, id="joins-late"),
        # 1 → 4 skips 2 and 3
        pytest.param([0, 1, 4, 5], [0, 1, 4, 5], 2, 1, 0, id="gap-without-replay"),
        pytest.param([0, 1, 2, 0, 1], [0, 1, 2, 0, 1], 0, 0, 1, id="publisher-restart"),
        pytest.param([3, 3], [3, 3], 0, 0, 1, id="same-seq-is-a-restart"),
    ],
)
def test_sequence_numbers(
    seqs: list[int], applied: list[int], missed: int, gaps: int, restarts: int
) -> None:
    s, sink = stream()
    for seq in seqs:
        assert s.on_message(frames(seq)) is None
    assert sink.timestamps() == [float(x) for x in applied]
    assert (s.stats.missed_batches, s.stats.gaps, s.stats.restarts) == (missed, gaps, restarts)
    assert len(sink.resets) == restarts


def test_topics_are_tracked_separately() -> None:
    s, sink = stream()
    for seq, topic in [(0, b"a"), (0, b"b"), (1, b"a"), (1, b"b")]:
        s.on_message(frames(seq, topic=topic))
    assert (s.stats.gaps, s.stats.restarts, len(sink.batches)) == (0, 0, 4)


def test_a_gap_with_replay_holds_the_batch_until_the_replay_is_applied() -> None:
    s, sink = stream(can_replay=True)
    s.on_message(frames(0))
    gap = s.on_message(frames(3))
    assert gap is not None and (gap.first_missing, gap.seq) == (1, 3)
    assert sink.timestamps() == [0.0]
    # the replay returns 1, 2 and (already live) 3, 4: only 1 and 2 are applied from it
    replayed = [(2, payload(2.0)), (1, payload(1.0)), (3, payload(3.0)), (4, payload(4.0))]
    s.finish_gap(gap, replayed)
    assert sink.timestamps() == [0.0, 1.0, 2.0, 3.0]
    assert (s.stats.replayed_batches, s.stats.missed_batches) == (2, 0)


def test_a_failed_replay_counts_the_missing_batches() -> None:
    s, sink = stream(can_replay=True)
    s.on_message(frames(0))
    gap = s.on_message(frames(4))
    assert gap is not None
    s.finish_gap(gap, None)
    assert sink.timestamps() == [0.0, 4.0]
    # 1, 2, 3 never arrived
    assert (s.stats.replay_failures, s.stats.missed_batches) == (1, 3)


def test_a_late_subscriber_with_replay_catches_up_from_zero() -> None:
    s, sink = stream(can_replay=True)
    gap = s.on_message(frames(2))
    assert gap is not None and gap.first_missing == 0
    s.finish_gap(gap, [(0, payload(0.0)), (1, payload(1.0))])
    assert sink.timestamps() == [0.0, 1.0, 2.0]
    assert s.stats.missed_batches == 0


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        pytest.param([b"t", b"\x00" * 8], "bad-frames", id="two-frames"),
        pytest.param([b"t", b"\x00" * 8, b"", b""], "bad-frames", id="four-frames"),
        pytest.param([b"t", b"\x00" * 7, payload(0)], "bad-seq", id="short-seq"),
        pytest.param([b"t", END, payload(0)], "bad-seq", id="negative-seq"),
        pytest.param([b"t", b"\x00" * 8, b"\xc1"], "not-msgpack", id="garbage-payload"),
    ],
)
def test_malformed_messages_are_counted_and_dropped(message: list[bytes], reason: str) -> None:
    s, sink = stream()
    s.on_message(message)
    assert s.stats.dropped == {reason: 1}
    assert sink.batches == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5), st.booleans())
def test_any_frames_never_raise(message: list[bytes], can_replay: bool) -> None:
    s, _ = stream(can_replay)
    s.on_message([b"t", (0).to_bytes(8, "big"), payload(0.0)])
    gap = s.on_message(message)
    if gap is not None:
        s.finish_gap(gap, [(gap.first_missing, b"\x00")])


@pytest.mark.parametrize(
    ("replay_frames", "expected"),
    [
        pytest.param([b"", b"\x00" * 7 + b"\x05", b"p"], (5, b"p"), id="dealer-3-frames"),
        pytest.param([b"\x00" * 7 + b"\x05", b"p"], (5, b"p"), id="2-frames"),
        pytest.param([b"topic", b"\x00" * 7 + b"\x05", b"p"], (5, b"p"), id="topic-3-frames"),
        pytest.param([b"", END, b""], (-1, b""), id="end"),
        pytest.param([b"x"], None, id="one-frame"),
        pytest.param([b"", b"\x05", b"p"], None, id="short-seq"),
    ],
)
def test_replay_frames(replay_frames: list[bytes], expected: tuple[int, bytes] | None) -> None:
    assert parse_replay_frames(replay_frames) == expected


def test_the_recorded_vllm_stream_shows_its_gap() -> None:
    s, _sink = stream()
    for entry in json.loads((FIXTURES / "index.json").read_text()):
        message = [(FIXTURES / name).read_bytes() for name in entry["frames"]]
        assert s.on_message(message) is None
    # recorded seqs 0 1 2 7 8 9: 3..6 were not kept by the recorder
    assert (s.stats.gaps, s.stats.missed_batches, s.stats.dropped) == (1, 4, {})
    assert s.stats.events == {"BlockStored": 6, "BlockRemoved": 48, "AllBlocksCleared": 1}


# -- real sockets ----------------------------------------------------------------------


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


async def test_subscriber_receives_the_simulators_publisher_over_tcp(
    context: zmq.asyncio.Context,
) -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "kv@x@m", encoding="array")
    sink = Sink()
    sub = KVEventSubscriber(context, publisher.endpoint, sink)
    task = asyncio.create_task(sub.run())
    try:
        await sub.ready.wait()
        stored = kv_cache.BlockStored([7], None, list(range(16)), 16, None, "GPU", None)
        # a subscription takes a moment to reach the publisher: publish until it arrives
        for i in range(200):
            publisher.publish([stored], float(i))
            await asyncio.sleep(0.01)
            if sink.batches:
                break
        publisher.publish([kv_cache.AllBlocksCleared()], 999.0)
        await wait_until(lambda: sink.batches and sink.batches[-1][1].ts == 999.0)
        assert sub.stats.gaps == 0 and sub.stats.dropped == {}
        first = sink.batches[0][1].events[0]
        assert isinstance(first, BlockStored) and list(first.block_hashes) == [7]
        assert sink.batches[-1][1].events == [AllBlocksCleared()]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        publisher.close()


async def test_a_gap_is_replayed_over_dealer_router(context: zmq.asyncio.Context) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pub = context.socket(zmq.PUB)
        router = context.socket(zmq.ROUTER)
        pub.bind(f"ipc://{tmp}/pub")
        router.bind(f"ipc://{tmp}/replay")
        sink = Sink()
        sub = KVEventSubscriber(
            context, f"ipc://{tmp}/pub", sink, replay_endpoint=f"ipc://{tmp}/replay"
        )
        task = asyncio.create_task(sub.run())
        requests: list[int] = []

        async def serve_replay() -> None:
            client, _empty, start = await router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            for seq in (1, 2, 3):
                await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload(seq)])
            await router.send_multipart([client, b"", END, b""])

        server = asyncio.create_task(serve_replay())
        try:
            await sub.ready.wait()
            while not sink.batches:  # slow joiner: resend seq 0 until it arrives
                await pub.send_multipart(frames(0))
                await asyncio.sleep(0.01)
            # seq 0 may have arrived several times (a restart each); now jump to 3
            await pub.send_multipart(frames(3))
            await wait_until(lambda: sink.timestamps()[-1:] == [3.0])
            assert requests == [1]
            assert sink.timestamps()[-3:] == [1.0, 2.0, 3.0]
            assert (sub.stats.replays, sub.stats.replayed_batches, sub.stats.missed_batches) == (
                1,
                2,
                0,
            )
        finally:
            for t in (task, server):
                t.cancel()
            await asyncio.gather(task, server, return_exceptions=True)
            pub.close(linger=0)
            router.close(linger=0)


async def test_a_replay_that_never_answers_times_out(context: zmq.asyncio.Context) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        silent = context.socket(zmq.ROUTER)
        silent.bind(f"ipc://{tmp}/replay")
        sub = KVEventSubscriber(
            context,
            f"ipc://{tmp}/none",
            Sink(),
            replay_endpoint=f"ipc://{tmp}/replay",
            replay_timeout_s=0.1,
        )
        assert await sub.replay(5) is None
        silent.close(linger=0)


async def test_a_bad_endpoint_ends_the_task_without_raising(context: zmq.asyncio.Context) -> None:
    sub = KVEventSubscriber(context, "nonsense://x", Sink())
    await asyncio.wait_for(sub.run(), 2.0)
    assert not sub.ready.is_set()


@pytest.mark.parametrize("optional", [True, False], ids=["guessed-replay", "configured-replay"])
async def test_a_guessed_replay_socket_that_is_missing_is_asked_once(
    context: zmq.asyncio.Context, optional: bool
) -> None:
    """Nothing configured, llm-d's replay port is a guess: when nobody answers there, the
    first gap costs one timeout and later gaps none; a configured one is always asked."""
    with tempfile.TemporaryDirectory() as tmp:
        pub = context.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp}/pub")
        sink = Sink()
        sub = KVEventSubscriber(
            context,
            f"ipc://{tmp}/pub",
            sink,
            replay_endpoint=f"ipc://{tmp}/no-replay",
            replay_timeout_s=0.05,
            replay_optional=optional,
        )
        task = asyncio.create_task(sub.run())
        try:
            await sub.ready.wait()
            while not sink.batches:  # slow joiner; the first batch (seq 0) needs no replay
                await pub.send_multipart(frames(0))
                await asyncio.sleep(0.01)
            for seq in (3, 6, 9):  # three gaps
                await pub.send_multipart(frames(seq))
                await wait_until(lambda s=seq: sink.timestamps()[-1:] == [float(s)])
            assert sub.stats.gaps == 3 and sub.stats.missed_batches == 6
            assert sub.stats.replays == (1 if optional else 3)
            assert sub.stats.replay_failures == (1 if optional else 3)
            assert (sub.replay_endpoint is None) is optional
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
