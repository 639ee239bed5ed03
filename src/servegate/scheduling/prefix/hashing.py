"""Chained block hashes of a prompt, the keys every prefix index shares.

Block i's key is xxh3-64 of the block's bytes seeded with block i-1's key; the
chain starts from a hash of the model (and LoRA adapter) name, so the same text
under two models never collides. Equal keys mean equal prefixes up to that block.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import xxhash

_h = xxhash.xxh3_64_intdigest
_BIG_ENDIAN = sys.byteorder == "big"


def chain_seed(model: str, lora: str | None = None) -> int:
    return _h(f"{model}\x00{lora or ''}".encode())


def keyed_seed(key: bytes, seed: int) -> int:
    """A 64-bit chain seed only holders of `key` can compute (a BLAKE2b keyed MAC of `seed`):
    block keys chained from it cannot be matched against guessed prompts without the key."""
    mac = hashlib.blake2b(seed.to_bytes(8, "little"), key=key[:64], digest_size=8)
    return int.from_bytes(mac.digest(), "little")


def char_block_hashes(text: str, block_chars: int, seed: int, max_blocks: int) -> list[int]:
    """Keys of the full `block_chars`-character blocks of `text` (a trailing partial block is
    not cached by any engine, so it has no key)."""
    data = text.encode("utf-8", "surrogatepass")
    n = min(len(data) // block_chars, max_blocks)
    out = []
    prev = seed
    for i in range(n):
        prev = _h(data[i * block_chars : (i + 1) * block_chars], prev)
        out.append(prev)
    return out


RECENT_PROMPTS = 256
"""`RecentChains`: prompts remembered (one per model seed and first block); with the
default 256 blocks to match at most 256 × 64 bytes each, so about 4 MB at worst."""


class RecentChains:
    """`char_block_hashes` that hashes only the blocks the latest prompt with the same
    first block key did not have.

    A prompt sent again, the next turn of a conversation (the last prompt plus more) and
    prompts behind one system prompt share their leading blocks with a prompt hashed
    before; those blocks' keys are taken from it after comparing the bytes (in C), and
    only the rest is hashed, one Python step per block. A block's key depends only on
    its bytes and the key before it, so equal first keys and equal bytes give equal keys:
    the keys are those `char_block_hashes` gives (a test compares them on random
    prompts). The lists returned are shared with the memo, as `request.cache`'s are with
    every scorer that reads them: callers must not change them.
    """

    __slots__ = ("_latest", "block_chars", "limit", "max_blocks")

    def __init__(self, block_chars: int, max_blocks: int, limit: int = RECENT_PROMPTS) -> None:
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.limit = limit
        self._latest: dict[int, tuple[bytes, list[int]]] = {}
        """first block's key → the latest such prompt's bytes (its hashed part at least)
        and keys."""

    def keys(self, text: str, seed: int) -> list[int]:
        b = self.block_chars
        data = text.encode("utf-8", "surrogatepass")
        n = min(len(data) // b, self.max_blocks)
        if n <= 0:
            return []
        span = n * b
        prev = first = _h(data[:b], seed)
        latest = self._latest
        held = latest.get(first)
        common = 0
        if held is not None:
            before, known = held
            m = min(n, len(known))
            if data == before:  # sent again, compared in place: every block hashed before
                return known
            cut = m * b
            common = m if data[:cut] == before[:cut] else _common_blocks(data, before, b, m)
        if common:
            keys = known[:common]
            if common == n:
                return keys if common < len(known) else known
            prev = keys[-1]
        else:
            keys = [first]
            common = 1
            if held is None and len(latest) >= self.limit:
                latest.clear()
        append = keys.append
        for i in range(common * b, span, b):
            prev = _h(data[i : i + b], prev)
            append(prev)
        latest[first] = (data if len(data) < span + b else data[:span], keys)
        return keys


def _common_blocks(data: bytes, before: bytes, b: int, m: int) -> int:
    """The most leading `b`-byte blocks (fewer than `m`) `data` and `before` share, by
    bisection; block `m` is not shared."""
    lo, hi = 0, m - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if data[: mid * b] == before[: mid * b]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_block_hashes(
    tokens: Sequence[int], block_tokens: int, seed: int, max_blocks: int
) -> list[int]:
    """Keys of the full `block_tokens`-token blocks of a token-id sequence.

    A block's bytes are its ids as 4-byte little-endian unsigned integers; `seed`
    is the chain's start, or the key of the block before the first one to continue
    a chain.
    """
    n = min(len(tokens) // block_tokens, max_blocks)
    if n <= 0:
        return []
    ids = array("I", tokens[: n * block_tokens])
    if _BIG_ENDIAN:
        ids.byteswap()
    data = memoryview(ids).cast("B")
    step = block_tokens * 4
    out = []
    prev = seed
    for start in range(0, n * step, step):
        prev = _h(data[start : start + step], prev)
        out.append(prev)
    return out
