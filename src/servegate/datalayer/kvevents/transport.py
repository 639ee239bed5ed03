"""The ZeroMQ side of KV events: frames, sequence numbers, gaps and replay.

A publisher sends `[topic, seq (8-byte big-endian), payload]` per batch, `seq`
growing by one per batch. A subscriber keeps the last sequence number per topic:

- the next number: the batch is decoded and handed to the sink;
- a jump forward: the missing batches are asked for on the publisher's replay
  ROUTER socket (`[b"", start_seq]` from a DEALER; answers `[b"", seq, payload]`
  per buffered batch, then seq -1 and an empty payload; 2- and 3-frame answers
  are both accepted), applied in order, then the batch that showed the gap.
  Without a replay socket, or when the replay fails, the missing batches are
  counted as missed;
- the same or a smaller number: the publisher restarted (a new engine has an
  empty cache), so the sink is told to forget that topic's blocks first.

On the first batch of a topic with a replay socket, batches buffered before it
are asked for too (a late subscriber catches up on what the engine already
holds). Malformed frames, sequence numbers and payloads are counted by reason
and dropped; nothing a publisher sends can stop the subscriber.

A bound subscriber (many publishers connect to it) cannot know from the frames
who sent them, so it takes an `admit(topic, peer_address, user_id)` check that
runs before anything else (sequence tracking included: a forged sequence number
could otherwise make a replica look restarted and wipe its blocks). With CURVE
the user id is the publisher's authenticated public key; without it the peer
address is the publisher's TCP source address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from servegate.curve import CurveKeys, ZapRegistry, peer_address, user_id
from servegate.datalayer.kvevents.decode import DecodeError, decode_batch
from servegate.scheduling.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

log = logging.getLogger(__name__)

END_SEQ = -1
SEQ_BYTES = 8
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""libzmq drops (and disconnects) a publisher whose frame is larger, before buffering it."""


class BatchSink(Protocol):
    """Where decoded batches go (an index, or a fan-out to several)."""

    def apply(self, topic: bytes, batch: EventBatch) -> None: ...

    def reset(self, topic: bytes) -> None:
        """The publisher of `topic` restarted: forget what it said before."""
        ...


@dataclass(slots=True)
class SubscriberStats:
    """What one subscriber has seen; exported by `KVEventsCollector`."""

    messages: int = 0
    """Live messages received (well-formed or not)."""
    batches: int = 0
    """Batches decoded and handed to the sink, live or replayed."""
    events: dict[str, int] = field(default_factory=dict)
    """Events handed to the sink, by type."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Frames, payloads and events dropped, by reason."""
    gaps: int = 0
    """Jumps in the sequence numbers."""
    missed_batches: int = 0
    """Batches skipped by a gap and not recovered by replay."""
    replays: int = 0
    """Replay requests sent."""
    replayed_batches: int = 0
    """Batches recovered by replay."""
    replay_failures: int = 0
    """Replays that timed out or could not be sent."""
    restarts: int = 0
    """Sequence numbers that went backwards (a publisher restarted)."""
    sink_errors: int = 0
    """Batches the sink raised on (a bug; the batch is skipped)."""

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


@dataclass(frozen=True, slots=True)
class Gap:
    """A live batch held back until the batches before it are replayed."""

    topic: bytes
    first_missing: int
    seq: int
    payload: bytes


def parse_seq(raw: bytes) -> int | None:
    if len(raw) != SEQ_BYTES:
        return None
    return int.from_bytes(raw, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule, used for the subscriber's side too: `*` or `::` means bind."""
    return "*" in endpoint or "::" in endpoint


Admit = Callable[[bytes, str | None, str | None], str | None]
"""`admit(topic, peer_address, user_id)` → None to accept a message, else the drop reason."""


class KVEventStream:
    """Sequence tracking and decoding, without sockets (the subscriber drives it)."""

    def __init__(self, sink: BatchSink, stats: SubscriberStats, can_replay: bool) -> None:
        self.sink = sink
        self.stats = stats
        self.can_replay = can_replay
        self.last: dict[bytes, int] = {}

    def on_message(self, frames: Sequence[bytes]) -> Gap | None:
        """Handle one live message; a `Gap` asks the caller to replay before applying it."""
        stats = self.stats
        stats.messages += 1
        if len(frames) != 3:
            stats.drop("bad-frames")
            return None
        topic, raw_seq, payload = frames
        seq = parse_seq(raw_seq)
        if seq is None or seq < 0:
            stats.drop("bad-seq")
            return None
        last = self.last.get(topic)
        if last is None:
            if seq > 0 and self.can_replay:
                return Gap(topic, 0, seq, payload)
        elif seq <= last:
            stats.restarts += 1
            self._reset(topic)
        elif seq > last + 1:
            stats.gaps += 1
            if self.can_replay:
                return Gap(topic, last + 1, seq, payload)
            stats.missed_batches += seq - last - 1
        self.apply(topic, seq, payload)
        return None

    def finish_gap(self, gap: Gap, replayed: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply what a replay returned (None: it failed), then the held-back batch."""
        stats = self.stats
        catching_up = gap.topic not in self.last
        expected = gap.first_missing
        if replayed is None:
            stats.replay_failures += 1
        else:
            for seq, payload in sorted(replayed):
                if seq < expected or seq >= gap.seq:
                    continue
                self.apply(gap.topic, seq, payload)
                stats.replayed_batches += 1
                expected = seq + 1
        if not catching_up:
            stats.missed_batches += max(0, gap.seq - expected)
        self.apply(gap.topic, gap.seq, gap.payload)

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        stats = self.stats
        self.last[topic] = seq
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            stats.drop(exc.reason)
            return
        for reason in batch.dropped:
            stats.drop(reason)
        try:
            self.sink.apply(topic, batch)
        except Exception:
            stats.sink_errors += 1
            log.exception("KV-event sink failed on a batch from topic %r", topic)
            return
        stats.batches += 1
        counts = stats.events
        for event in batch.events:
            name = (
                "BlockStored"
                if isinstance(event, BlockStored)
                else "BlockRemoved"
                if isinstance(event, BlockRemoved)
                else "AllBlocksCleared"
                if isinstance(event, AllBlocksCleared)
                else "other"
            )
            counts[name] = counts.get(name, 0) + 1

    def _reset(self, topic: bytes) -> None:
        try:
            self.sink.reset(topic)
        except Exception:
            self.stats.sink_errors += 1
            log.exception("KV-event sink failed to reset topic %r", topic)


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """`[b"", seq, payload]`, `[seq, payload]` or `[topic, seq, payload]` → (seq, payload)."""
    if len(frames) == 2:
        raw_seq, payload = frames
    elif len(frames) == 3:
        raw_seq, payload = frames[1], frames[2]
    else:
        return None
    seq = parse_seq(raw_seq)
    return None if seq is None else (seq, payload)


class KVEventSubscriber:
    """One SUB socket (connected to a publisher, or bound for many) and its replay socket."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        sink: BatchSink,
        *,
        replay_endpoint: str | None = None,
        topic_filter: str = "",
        replay_timeout_s: float = 2.0,
        name: str | None = None,
        stats: SubscriberStats | None = None,
        bind: bool | None = None,
        curve: CurveKeys | None = None,
        admit: Admit | None = None,
        replay_optional: bool = False,
    ) -> None:
        """`bind`: None = vLLM's rule (`binds`); `curve`: a bound socket is a CURVE server
        that admits only `curve.authorized` publisher keys, a connected one a CURVE client of
        `curve.server`; `admit`: checked per message before anything else;
        `replay_optional`: the replay socket is a guess (nothing configured), so the first
        replay that fails turns replay off for this subscriber, said once."""
        self.context = context
        self.endpoint = endpoint
        self.bind = binds(endpoint) if bind is None else bind
        self.curve = curve
        self.admit = admit
        self.replay_endpoint = replay_endpoint
        self.topic_filter = topic_filter
        self.replay_timeout_s = replay_timeout_s
        self.replay_optional = replay_optional
        self.name = name or endpoint
        self.stats = stats or SubscriberStats()
        self.stream = KVEventStream(sink, self.stats, can_replay=replay_endpoint is not None)
        self.ready = asyncio.Event()
        """Set once the socket is connected (or bound) and subscribed."""
        self.bound_endpoint: str | None = None
        """The address a bound socket got (its port, when the endpoint said `*`)."""
        self.zap_domain: str | None = None

    @property
    def refused(self) -> int:
        """Publishers a CURVE bind socket turned away (keys not authorized)."""
        return ZapRegistry.refused(self.zap_domain) if self.zap_domain is not None else 0

    async def run(self) -> None:
        """Receive until cancelled; a bad endpoint string ends the task with a log line."""
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        domain: str | None = None
        try:
            try:
                sock.setsockopt(zmq.SUBSCRIBE, self.topic_filter.encode())
                if self.bind:
                    if self.curve is not None:
                        domain = self.zap_domain = ZapRegistry.server(sock, self.curve)
                    sock.bind(self.endpoint)
                else:
                    if self.curve is not None:
                        self.curve.client(sock)
                    sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                verb = "bind" if self.bind else "connect to"
                log.error("KV events: cannot %s %s: %s", verb, self.endpoint, exc)
                return
            if self.bind:
                last = sock.getsockopt(zmq.LAST_ENDPOINT)
                self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
            self.ready.set()
            admit = self.admit
            while True:
                if admit is None:
                    frames = await sock.recv_multipart()
                else:
                    raw = await sock.recv_multipart(copy=False)
                    frames = [frame.bytes for frame in raw]
                    reason = admit(frames[0], peer_address(raw[0]), user_id(raw[0]))
                    if reason is not None:
                        self.stats.messages += 1
                        self.stats.drop(reason)
                        continue
                gap = self.stream.on_message(frames)
                if gap is not None:
                    self.stats.replays += 1
                    replayed = await self.replay(gap.first_missing)
                    self.stream.finish_gap(gap, replayed)
                    if replayed is None and self.replay_optional:
                        self._drop_replay()
        finally:
            sock.close(linger=0)
            if domain is not None:
                ZapRegistry.release(domain)
                self.zap_domain = None

    def _drop_replay(self) -> None:
        log.info(
            "KV events from %s: no replay socket answers at %s (llm-d's default port); "
            "batches lost to a gap are counted as missed",
            self.name,
            self.replay_endpoint,
        )
        self.replay_endpoint = None
        self.stream.can_replay = False

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches from `start` on, from the replay socket; None when it fails or times out."""
        if self.replay_endpoint is None:
            return None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is not None:
            self.curve.client(dealer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000.0):
                    log.warning("KV events: replay from %s timed out", self.replay_endpoint)
                    return None
                frames = await dealer.recv_multipart()
                parsed = parse_replay_frames(frames)
                if parsed is None:
                    self.stats.drop("bad-replay-frames")
                    continue
                seq, payload = parsed
                if seq == END_SEQ:
                    return out
                out.append((seq, payload))
        except zmq.ZMQError as exc:
            log.warning("KV events: replay from %s failed: %s", self.replay_endpoint, exc)
            return None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
