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
