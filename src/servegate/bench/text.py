"""Seeded synthetic text, so workloads need no dataset or tokenizer download.

Lengths are given in tokens and produced as words: one word stands for one token.
Words are 2-4 lowercase letters (3.1 on average), so a word plus its separating space
is about 4.1 characters, and the common "4 characters ≈ 1 token" estimate agrees
within a few percent. A trained BPE tokenizer may split a made-up word into more than
one token; where exact counts matter, read `usage.prompt_tokens` in the results.
"""

from __future__ import annotations

import random

CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiou"
VOCABULARY_SIZE = 2048
VOCABULARY_SEED = 20240917


def build_vocabulary(size: int = VOCABULARY_SIZE, seed: int = VOCABULARY_SEED) -> tuple[str, ...]:
    """Distinct made-up words, shortest first; fixed by `seed`, not by any workload seed.

    All consonant-vowel(-consonant) words come first (1710 of them), then as many
    two-syllable consonant-vowel-consonant-vowel words as `size` needs.
    """
    short = [c + v for c in CONSONANTS for v in VOWELS]
    short += [c + v + k for c in CONSONANTS for v in VOWELS for k in CONSONANTS]
    open_syllables = short[: len(CONSONANTS) * len(VOWELS)]
    long = [a + b for a in open_syllables for b in open_syllables]
    rng = random.Random(seed)
    rng.shuffle(long)
    vocabulary = (short + long)[:size]
    if len(vocabulary) < size:
        raise ValueError(f"at most {len(short) + len(long)} words can be built, asked {size}")
    rng.shuffle(vocabulary)
    return tuple(vocabulary)


VOCABULARY = build_vocabulary()


def words(rng: random.Random, count: int) -> str:
    """`count` words drawn from the vocabulary with `rng`, joined by single spaces."""
    if count <= 0:
        return ""
    return " ".join(rng.choices(VOCABULARY, k=count))


def approx_tokens(text: str) -> int:
    """The token count these workloads assume: one per whitespace-separated word."""
    return len(text.split())
