"""A test-side subscriber for vLLM's KV-cache events, and a reference prefix index.

`decode_batch` accepts every encoding in shared/PROTOCOLS.md §3 (a batch and each
event as a msgpack array or map), so these tests hold whatever this vLLM sends.
`ReferenceIndex` is the simplest correct model of the engine's prefix cache: full
token blocks chained from the start of the prompt, per LoRA adapter, added by
`BlockStored` and dropped by `BlockRemoved`/`AllBlocksCleared`. The engine-tier
tests check it against the engine's own hit counter; servegate's precise prefix
index (a later issue) must then agree with it on the same events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from servegate.testing.vllm_cluster import VllmServer

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
REMOVED_FIELDS = ("block_hashes", "medium")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class Message:
    topic: bytes
    seq: int
    ts: float
    events: tuple[Event, ...]
    frames: tuple[bytes, ...]


def _key(value: Any) -> Hashable:
    return bytes(value) if isinstance(value, bytearray | list) else value


def decode_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag, fields = raw["type"], raw
    else:
        tag = raw[0]
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=tuple(_key(h) for h in fields["block_hashes"]),
            parent_block_hash=_key(fields.get("parent_block_hash")),
            token_ids=tuple(int(t) for t in fields["token_ids"]),
            block_size=int(fields["block_size"]),
            lora_id=fields.get("lora_id"),
            medium=fields.get("medium"),
            lora_name=fields.get("lora_name"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(_key(h) for h in fields["block_hashes"]),
            medium=fields.get("medium"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {tag!r}")


def decode_batch(payload: bytes) -> tuple[float, tuple[Event, ...]]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, events = batch["ts"], batch["events"]
    else:
        ts, events = batch[0], batch[1]
    return float(ts), tuple(decode_event(e) for e in events)


class KvSubscriber:
    """Collects every message one server publishes, from a background thread."""

    def __init__(self, server: VllmServer, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.server = server
        self.messages: list[Message] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, server.topic.encode())
        self._sock.connect(server.kv_connect)
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{server.index}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                topic, seq, payload = frames
                ts, events = decode_batch(payload)
                message = Message(
                    topic, int.from_bytes(seq, "big", signed=True), ts, events, tuple(frames)
                )
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.messages.append(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def mark(self) -> int:
        with self._lock:
            return len(self.messages)

    def since(self, mark: int) -> list[Message]:
        with self._lock:
            return self.messages[mark:]

    def events_since(self, mark: int) -> list[Event]:
        return [e for m in self.since(mark) for e in m.events]

    def wait(
        self, mark: int, done: Callable[[list[Event]], bool], timeout_s: float = 10.0
    ) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while True:
            events = self.events_since(mark)
            if done(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"server {self.server.index}: expected KV events did not arrive in "
                    f"{timeout_s} s; got {events!r:.2000}"
                )
            time.sleep(0.05)


class ReferenceIndex:
    """Engine block hash → the full token prefix it caches (per adapter)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prefix_of: dict[Hashable, tuple[str | None, tuple[int, ...]]] = {}
        self._cached: set[tuple[str | None, tuple[int, ...]]] = set()

    def apply(self, event: Event) -> None:
        if isinstance(event, AllBlocksCleared):
            self._prefix_of.clear()
            self._cached.clear()
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = self._prefix_of.pop(h, None)
                if key is not None:
                    self._cached.discard(key)
        else:
            assert event.block_size == self.block_size
            assert len(event.token_ids) == len(event.block_hashes) * self.block_size
            prefix: tuple[int, ...] = ()
            if event.parent_block_hash is not None:
                parent = self._prefix_of.get(event.parent_block_hash)
                if parent is None:
                    return
                prefix = parent[1]
            for i, h in enumerate(event.block_hashes):
                block = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
                prefix = prefix + block
                key = (event.lora_name, prefix)
                self._prefix_of[h] = key
                self._cached.add(key)

    def cached_blocks(self, tokens: list[int], lora: str | None = None) -> int:
        """Consecutive full blocks of `tokens`, from the start, that the engine holds."""
        n = 0
        while (n + 1) * self.block_size <= len(tokens):
            if (lora, tuple(tokens[: (n + 1) * self.block_size])) not in self._cached:
                break
            n += 1
        return n

    def predicted_hit_tokens(self, tokens: list[int], lora: str | None = None) -> int:
        """Prompt tokens the engine will serve from cache: vLLM always computes the last one."""
        hit = self.cached_blocks(tokens, lora) * self.block_size
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        return min(hit, usable)
