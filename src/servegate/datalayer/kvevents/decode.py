"""vLLM / SGLang KV-event payloads (msgpack) → `EventBatch`.

A batch is `[ts, [event, ...], data_parallel_rank?]` or a map with `ts`,
`events`, `data_parallel_rank`. Recent vLLM tags each event as a map with
`"type"`; older vLLM and SGLang send a positional array whose first element is
the tag (PROTOCOLS.md §3). Fields after the ones listed here (`extra_keys`,
`group_idx`, `kv_cache_spec_kind`, ...) are ignored.

Nothing here raises on bad input except `DecodeError` for a payload that is not
a batch at all; a malformed event is dropped and its reason recorded in
`EventBatch.dropped`, so one bad event does not cost the rest of the batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

import msgpack

from servegate.scheduling.prefix.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)

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

REASONS = (
    "not-msgpack",
    "bad-batch",
    "bad-event",
    "unknown-event-type",
    "bad-block-hashes",
    "bad-token-ids",
    "bad-block-size",
    "token-count-mismatch",
    "bad-field",
)
"""Every reason a payload or an event is dropped (metric label values)."""


class DecodeError(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class _BadEvent(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list):
        raise _BadEvent("bad-block-hashes")
    for h in value:
        if not isinstance(h, int | bytes) or isinstance(h, bool):
            raise _BadEvent("bad-block-hashes")
    return value


def _parent(value: Any) -> BlockHash | None:
    if value is None or (isinstance(value, int | bytes) and not isinstance(value, bool)):
        return value
    raise _BadEvent("bad-block-hashes")


def _optional(value: Any, kind: type) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise _BadEvent("bad-field")


def _stored(fields: Mapping[str, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    size = fields.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise _BadEvent("bad-block-size")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list):
        raise _BadEvent("bad-token-ids")
    if len(tokens) != len(hashes) * size:
        raise _BadEvent("token-count-mismatch")
    try:
        ids = array("I", tokens)
    except (TypeError, OverflowError):
        raise _BadEvent("bad-token-ids") from None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=_parent(fields.get("parent_block_hash")),
        token_ids=ids,
        block_size=size,
        lora_id=_optional(fields.get("lora_id"), int),
        lora_name=_optional(fields.get("lora_name"), str),
        medium=_optional(fields.get("medium"), str),
    )


def _removed(fields: Mapping[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(fields.get("block_hashes")),
        medium=_optional(fields.get("medium"), str),
    )


def decode_event(raw: Any) -> Event:
    """One event in map or array form; raises `DecodeError` with the drop reason."""
    try:
        if isinstance(raw, dict):
            tag = raw.get("type")
            fields: Mapping[str, Any] = raw
        elif isinstance(raw, list) and raw:
            tag = raw[0]
            names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
            fields = dict(zip(names, raw[1:], strict=False))
        else:
            raise _BadEvent("bad-event")
        if tag == "BlockStored":
            return _stored(fields)
        if tag == "BlockRemoved":
            return _removed(fields)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise _BadEvent("unknown-event-type" if isinstance(tag, str) else "bad-event")
    except _BadEvent as exc:
        raise DecodeError(exc.reason) from None


def decode_batch(payload: bytes) -> EventBatch:
    """A payload → its events; raises `DecodeError` only when it is not a batch at all."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise DecodeError("not-msgpack", type(exc).__name__) from None
    if isinstance(batch, dict):
        ts, events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    else:
        raise DecodeError("bad-batch", "not an array or map of [ts, events, rank]")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise DecodeError("bad-batch", "ts must be a number and events an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise DecodeError("bad-batch", "data_parallel_rank must be an integer")
    out = EventBatch(ts=float(ts), events=[], data_parallel_rank=rank)
    append = out.events.append
    for raw in events:
        try:
            append(decode_event(raw))
        except DecodeError as exc:
            out.dropped.append(exc.reason)
    return out
