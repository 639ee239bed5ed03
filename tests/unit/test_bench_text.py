from __future__ import annotations

import random
import statistics

import pytest

from servegate.bench import text


def test_vocabulary_is_fixed_distinct_and_short() -> None:
    assert text.build_vocabulary() == text.VOCABULARY
    assert len(set(text.VOCABULARY)) == text.VOCABULARY_SIZE
    assert all(2 <= len(word) <= 4 and word.isalpha() for word in text.VOCABULARY)


def test_average_word_is_about_four_characters_with_its_space() -> None:
    # The module promises one word ~ one token under "4 characters per token".
    sample = text.words(random.Random(0), 5000)
    assert len(sample) / 5000 == pytest.approx(4.1, abs=0.3)
    assert statistics.mean(len(w) for w in text.VOCABULARY) == pytest.approx(3.1, abs=0.1)


@pytest.mark.parametrize(("count", "expected"), [(0, 0), (1, 1), (37, 37)])
def test_words_gives_the_asked_count(count: int, expected: int) -> None:
    assert text.approx_tokens(text.words(random.Random(1), count)) == expected


def test_words_are_seeded() -> None:
    assert text.words(random.Random(3), 20) == text.words(random.Random(3), 20)
    assert text.words(random.Random(3), 20) != text.words(random.Random(4), 20)


def test_too_large_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        text.build_vocabulary(size=10**6)
