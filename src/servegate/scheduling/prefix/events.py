"""KV-cache events as plain data, whatever engine or encoding they came from.

An engine's block hash is an opaque key (bytes or an int, in the engine's own
algorithm and seed); the index never interprets it. `medium` says which tier
holds the block (`GPU`, `CPU`, ...; None means the accelerator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    """Every token of the stored blocks: `len(block_hashes) × block_size` ids."""
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[BlockHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published message: what one engine step changed."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    dropped: list[str] = field(default_factory=list)
    """Why events of this batch were dropped while decoding (one reason per event)."""
