"""The KV-cache block manager, modelled on vLLM v1's `BlockPool` and `KVCacheManager`.

Pure and synchronous, so every rule can be checked block by block in unit tests:

- `num_blocks` blocks of `block_size` tokens; block 0 is vLLM's reserved null
  block, so `num_blocks - 1` hold tokens and usage = 1 - free / (num_blocks - 1).
- A full block is identified by a hash chained from its parent block's hash,
  its token ids and an extra key (the LoRA adapter), as vLLM's
  `hash_block_tokens`. Only full blocks are cached.
- A lookup matches leading full blocks of a sequence but at most
  `num_tokens - 1` tokens: the last prompt token is always computed again.
- Blocks are reference counted. A cached block whose count drops to 0 goes to
  the tail of the free queue *and keeps its hash*; allocation takes blocks from
  the head (least recently freed first) and only then evicts the hash it held. A
  sequence frees its blocks last-to-first, so the tail of a prompt is evicted
  before its head, as vLLM does. A freed block without a hash (the partial last
  block, which can never be hit) goes to the *head*, so it is reused before any
  cached block is evicted (vLLM >= 0.11's `free_blocks`).
- Blocks are cached (and `BlockStored` emitted) when they are allocated for the
  tokens that fill them, before the step computes them, as vLLM does.
- Two sequences can compute the same block at the same time; both copies are
  kept under one hash, and evicting either one reports the hash as removed.

Every change to the set of cached hashes is appended to `events` (drained by
the engine once per step and published on ZMQ).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

MEDIUM_GPU = "GPU"
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def hash_block(parent: int, token_ids: Sequence[int], extra: int) -> int:
    """Chained key of one full block: deterministic in every process (ints and
    tuples of ints hash without Python's per-process string salt)."""
    return hash((parent, tuple(token_ids), extra)) & _MASK64


def block_hashes_of(
    token_ids: Sequence[int], block_size: int, root: int, extra: int = 0, prev: Sequence[int] = ()
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, continuing the chain `prev`
    (hashes already known for the first `len(prev)` blocks)."""
    out = list(prev)
    parent = out[-1] if out else root
    for begin in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra)
        out.append(parent)
    return out


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass(slots=True, eq=False)
class SeqBlocks:
    """The blocks one sequence holds, and how many of them are cached."""

    lora_id: int | None = None
    lora_name: str | None = None
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class KVCache:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self._blocks[1:])
        self._cached: dict[int, dict[int, Block]] = {}
        self.events: list[KVEvent] = []
        self.evictions = 0

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached or not)."""
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def block(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def free_queue(self) -> list[int]:
        """Free block ids, next to be allocated first."""
        return list(self._free)

    # -- the manager's operations ----------------------------------------------

    def find_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[Block]:
        """Cached blocks matching the leading full blocks, leaving at least the
        last token to compute (vLLM's `get_computed_blocks`)."""
        if not self.enable_prefix_caching:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        for i in range(limit):
            holders = self._cached.get(block_hashes[i])
            if not holders:
                break
            hits.append(next(iter(holders.values())))
        return hits

    def allocate(
        self,
        seq: SeqBlocks,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached: Sequence[Block] = (),
    ) -> bool:
        """Room for `num_new_tokens` after `num_computed_tokens` (which include the
        `cached` hit blocks being added now); False, changing nothing, when too few
        blocks are free (vLLM's `allocate_slots`)."""
        bs = self.block_size
        required = -(-(num_computed_tokens + num_new_tokens) // bs)
        num_new_blocks = required - len(seq.blocks) - len(cached)
        evictable_hits = sum(1 for b in cached if b.ref_cnt == 0)
        if num_new_blocks > len(self._free) - evictable_hits:
            return False
        for block in cached:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        seq.blocks.extend(cached)
        if cached and seq.num_cached_blocks == len(seq.blocks) - len(cached):
            seq.num_cached_blocks = len(seq.blocks)
        for _ in range(max(0, num_new_blocks)):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            seq.blocks.append(block)
        return True

    def cache_full_blocks(
        self, seq: SeqBlocks, block_hashes: Sequence[int], token_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Cache the blocks that `num_tokens` tokens fill, hashed as `block_hashes`."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        upto = min(num_tokens // bs, len(block_hashes), len(seq.blocks))
        first = seq.num_cached_blocks
        if upto <= first:
            return
        stored: list[int] = []
        for i in range(first, upto):
            block = seq.blocks[i]
            if block.block_hash is not None:
                continue
            h = block_hashes[i]
            block.block_hash = h
            self._cached.setdefault(h, {})[block.block_id] = block
            stored.append(h)
        seq.num_cached_blocks = upto
        if stored:
            self.events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                    token_ids=list(token_ids[first * bs : upto * bs]),
                    block_size=bs,
                    lora_id=seq.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=seq.lora_name,
                )
            )

    def free(self, seq: SeqBlocks) -> None:
        """Release a sequence's blocks, last block first (vLLM's `free_blocks`): a cached
        block goes to the tail of the free queue, an uncached one (a partial block, or
        any block without prefix caching) to the head, so it is reused before any
        cached block is evicted."""
        reuse_first: list[Block] = []
        for block in reversed(seq.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    reuse_first.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(reuse_first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        seq.blocks = []
        seq.num_cached_blocks = 0

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's `reset_prefix_cache`); False while any
        block is held."""
        if len(self._free) != self.usable_blocks:
            return False
        for holders in self._cached.values():
            for block in holders.values():
                block.block_hash = None
        self._cached.clear()
        self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        holders = self._cached.get(h)
        if holders is not None:
            holders.pop(block.block_id, None)
            if not holders:
                del self._cached[h]
        block.block_hash = None
        self.evictions += 1
        self.events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU))
