"""Bus messages and their msgpack wire form.

A message is `[version, kind, origin, pool, hops, body]`. `origin` names the
process that produced the state (`<replica>/<worker>`), `hops` is 1 once a
replica bridge has carried it to another host (a bridge never forwards it again).
Everything read from the wire is checked before use: anything malformed raises
`DecodeError` and is counted and dropped by the receiver, never applied. Numbers
are range-checked too: in-flight counts over `pool.sanity.MAX_IN_FLIGHT`
(requests) or `MAX_IN_FLIGHT_TOKENS`, a prefix capacity over `MAX_CAPACITY` or
more than `MAX_KEYS_PER_ENTRY` keys in one insertion make the message invalid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from servegate.pool.endpoint import EndpointMetrics, LoraInfo
from servegate.pool.pool import ModelEntry
from servegate.pool.sanity import MAX_IN_FLIGHT, MAX_IN_FLIGHT_TOKENS

VERSION = 1
INFLIGHT = "inflight"
PREFIX = "prefix"
METRICS = "metrics"
GONE = "gone"
KINDS = frozenset({INFLIGHT, PREFIX, METRICS, GONE})
REPLICATED = frozenset({INFLIGHT, PREFIX, GONE})
"""Kinds a replica bridge carries between hosts; metrics are scraped by every replica."""

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_NAME = 512
MAX_KEY = (1 << 64) - 1
MAX_CAPACITY = 1 << 24
"""Blocks one endpoint's prefix LRU may be told to hold (far above any GPU's block count)."""
MAX_KEYS_PER_ENTRY = 1 << 16


class DecodeError(ValueError):
    """Bytes that are not a valid bus message."""


@dataclass(frozen=True, slots=True)
class InFlight:
    address: str
    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class PrefixInsert:
    plugin: str
    address: str
    capacity: int | None
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EndpointReport:
    address: str
    healthy: bool
    metrics: EndpointMetrics
    served: tuple[ModelEntry, ...]


Body = tuple[InFlight, ...] | tuple[PrefixInsert, ...] | tuple[EndpointReport, ...] | None


@dataclass(frozen=True, slots=True)
class Message:
    kind: str
    origin: str
    pool: str
    body: Body = None
    hops: int = 0


def encode(msg: Message) -> bytes:
    body: list[Any] | None = None
    if msg.kind != GONE:
        body = []
        for item in msg.body or ():
            if isinstance(item, InFlight):
                body.append([item.address, item.requests, item.tokens])
            elif isinstance(item, PrefixInsert):
                body.append([item.plugin, item.address, item.capacity, list(item.keys)])
            else:
                body.append(_encode_report(item))
    data: bytes = msgpack.packb([VERSION, msg.kind, msg.origin, msg.pool, msg.hops, body])
    return data


def with_hops(msg: Message, hops: int) -> Message:
    return Message(msg.kind, msg.origin, msg.pool, msg.body, hops)


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"not msgpack: {type(exc).__name__}") from exc
    if not isinstance(doc, list) or len(doc) != 6:
        raise DecodeError("a message is a 6-element array")
    version, kind, origin, pool, hops, body = doc
    if version != VERSION:
        raise DecodeError(f"unsupported message version {version!r}")
    if kind not in KINDS:
        raise DecodeError(f"unknown message kind {kind!r}")
    origin = _name(origin, "origin")
    pool = _name(pool, "pool")
    if type(hops) is not int or hops not in (0, 1):
        raise DecodeError("hops must be 0 or 1")
    return Message(kind, origin, pool, _decode_body(kind, body), hops)


def _decode_body(kind: str, body: Any) -> Body:
    if kind == GONE:
        return None
    if not isinstance(body, list):
        raise DecodeError(f"a {kind} body is an array")
    if kind == INFLIGHT:
        return tuple(_inflight(item) for item in body)
    if kind == PREFIX:
        return tuple(_prefix(item) for item in body)
    return tuple(_report(item) for item in body)


def _inflight(item: Any) -> InFlight:
    if not isinstance(item, list) or len(item) != 3:
        raise DecodeError("an in-flight entry is [address, requests, tokens]")
    requests, tokens = _count(item[1]), _count(item[2])
    if requests > MAX_IN_FLIGHT or tokens > MAX_IN_FLIGHT_TOKENS:
        raise DecodeError(f"in-flight counts over {MAX_IN_FLIGHT} requests / "
                          f"{MAX_IN_FLIGHT_TOKENS} tokens")  # fmt: skip
    return InFlight(_name(item[0], "address"), requests, tokens)


def _prefix(item: Any) -> PrefixInsert:
    if not isinstance(item, list) or len(item) != 4:
        raise DecodeError("a prefix entry is [plugin, address, capacity, keys]")
    plugin, address, capacity, keys = item
    if capacity is not None:
        capacity = _count(capacity)
        if not 1 <= capacity <= MAX_CAPACITY:
            raise DecodeError(f"capacity must be in [1, {MAX_CAPACITY}]")
    if isinstance(keys, list) and len(keys) > MAX_KEYS_PER_ENTRY:
        raise DecodeError(f"more than {MAX_KEYS_PER_ENTRY} keys in one insertion")
    if not isinstance(keys, list) or not all(type(k) is int and 0 <= k <= MAX_KEY for k in keys):
        raise DecodeError("prefix keys are unsigned 64-bit integers")
    return PrefixInsert(_name(plugin, "plugin"), _name(address, "address"), capacity, tuple(keys))


def _encode_report(r: EndpointReport) -> list[Any]:
    m = r.metrics
    lora = (
        None
        if m.lora is None
        else [m.lora.max_lora, sorted(m.lora.running), sorted(m.lora.waiting)]
    )
    return [
        r.address,
        r.healthy,
        [
            m.waiting, m.running, m.kv_usage, m.block_size, m.num_blocks, lora,
            m.prefix_cache_queries, m.prefix_cache_hits, m.scraped_at,
        ],
        [[e.id, e.parent] for e in r.served],
    ]  # fmt: skip


def _report(item: Any) -> EndpointReport:
    if not isinstance(item, list) or len(item) != 4:
        raise DecodeError("an endpoint report is [address, healthy, metrics, served]")
    address, healthy, metrics, served = item
    if type(healthy) is not bool:
        raise DecodeError("healthy is a boolean")
    if not isinstance(metrics, list) or len(metrics) != 9:
        raise DecodeError("endpoint metrics are a 9-element array")
    waiting, running, kv, block_size, num_blocks, lora, pq, ph, scraped_at = metrics
    if not isinstance(served, list):
        raise DecodeError("served models are an array")
    models = []
    for entry in served:
        if not isinstance(entry, list) or len(entry) != 2:
            raise DecodeError("a served model is [id, parent]")
        parent = None if entry[1] is None else _name(entry[1], "parent")
        models.append(ModelEntry(_name(entry[0], "model"), parent))
    return EndpointReport(
        _name(address, "address"),
        healthy,
        EndpointMetrics(
            waiting=_number(waiting),
            running=_number(running),
            kv_usage=_number(kv),
            block_size=None if block_size is None else _count(block_size),
            num_blocks=None if num_blocks is None else _count(num_blocks),
            lora=None if lora is None else _lora(lora),
            prefix_cache_queries=None if pq is None else _number(pq),
            prefix_cache_hits=None if ph is None else _number(ph),
            scraped_at=_number(scraped_at),
        ),
        tuple(models),
    )


def _lora(item: Any) -> LoraInfo:
    if not isinstance(item, list) or len(item) != 3:
        raise DecodeError("LoRA info is [max_lora, running, waiting]")
    running, waiting = item[1], item[2]
    if not isinstance(running, list) or not isinstance(waiting, list):
        raise DecodeError("LoRA running/waiting are arrays")
    return LoraInfo(
        _count(item[0]),
        frozenset(_name(a, "adapter") for a in running),
        frozenset(_name(a, "adapter") for a in waiting),
    )


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise DecodeError(f"{what} must be a non-empty string of at most {MAX_NAME} characters")
    return value


def _count(value: Any) -> int:
    if type(value) is not int or value < 0 or value > MAX_KEY:
        raise DecodeError(f"expected a non-negative integer, got {type(value).__name__}")
    return value


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise DecodeError(f"expected a finite number, got {type(value).__name__}")
    return float(value)
