"""KV-cache events on ZeroMQ, byte for byte as vLLM's `ZmqEventPublisher` sends them.

Each batch is one PUB message of three frames: the topic, an 8-byte big-endian
sequence number (+1 per batch) and a msgpack payload `[ts, [event, ...], dp_rank]`
(the batch is an array in every vLLM version). Events are encoded as

- `map` (vLLM >= 0.10, msgspec tagged structs): `{"type": "BlockStored",
  "block_hashes": [...], "parent_block_hash": h|None, "token_ids": [...],
  "block_size": n, "lora_id": id|None, "medium": "GPU", "lora_name": name|None}`,
  `{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}`,
  `{"type": "AllBlocksCleared"}`;
- `array` (older vLLM, SGLang): the same fields in that order after the tag,
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`.

A replay ROUTER socket answers `[identity, b"", start_seq]` with one
`[identity, b"", seq, payload]` per buffered batch from `start_seq` on, then
`[identity, b"", -1 (8 bytes), b""]`. Sockets live in one background thread so
the event loop never blocks on ZeroMQ.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from servegate.simulator.kv_cache import BlockRemoved, BlockStored, KVEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent, encoding: str) -> Any:
    if isinstance(event, BlockStored):
        if encoding == "array":
            return [
                "BlockStored",
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", event.block_hashes, event.medium]
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if encoding == "array":
        return ["AllBlocksCleared"]
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[KVEvent], ts: float, encoding: str, dp_rank: int = 0) -> bytes:
    payload = [ts, [encode_event(e, encoding) for e in events], dp_rank]
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard, IPv6 any, ipc:// and inproc://; else connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[1] == "0":
        endpoint = endpoint.rsplit(":", 1)[0] + ":*"
    sock.bind(endpoint)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


class ZmqEventPublisher:
    """Publishes engine events; `publish` only enqueues and never blocks."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        encoding: str = "map",
        replay_endpoint: str | None = None,
        bind: bool | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        dp_rank: int = 0,
    ) -> None:
        self.topic = topic
        self.encoding = encoding
        self.dp_rank = dp_rank
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        should_bind = binds(endpoint) if bind is None else bind
        try:
            if should_bind:
                self.endpoint = _bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self._replay: zmq.Socket[bytes] | None = None
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._queue: queue.SimpleQueue[tuple[Sequence[KVEvent], float] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.published = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KVEvent], ts: float) -> None:
        if not self._closed and events:
            self._queue.put((events, ts))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            events, ts = item
            payload = encode_batch(events, ts, self.encoding, self.dp_rank)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                continue
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
