"""The built-in tokenizer is a public contract: pinned ids, exact round trips, chat prefixes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servegate.simulator import tokenizer as tok


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", [], id="empty"),
        pytest.param("the", [16], id="first-vocab-word"),  # word 0, bare: 16 + 2*0
        pytest.param(" the", [17], id="first-vocab-word-with-space"),  # 16 + 2*0 + 1
        pytest.param("<|user|>", [4], id="chat-marker"),
        pytest.param("</s>", [tok.EOS_ID], id="eos-marker"),
        pytest.param("\n", [tok._B1 + 10], id="newline-byte"),  # 1-byte chunk 0x0a
        pytest.param("zz", [tok._B2 + 0x7A7A], id="two-byte-chunk"),
        pytest.param("zzzz", [tok._B3 + 0x7A7A7A, tok._B1 + 0x7A], id="chunked-3-then-1"),
    ],
)
def test_pinned_ids(text: str, expected: list[int]) -> None:
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text


def test_common_english_is_about_one_token_per_word() -> None:
    text = "Please summarize the following document about the model and the cache."
    ids = tok.encode(text)
    # 11 words (each a vocab word, with its leading space) + the final "."
    assert len(ids) == 12


@given(st.text(max_size=200))
def test_round_trip(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@given(st.lists(st.text(max_size=40), min_size=1, max_size=5))
def test_conversation_prefix_is_a_token_prefix(turns: list[str]) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    full = tok.encode_chat(messages)
    for k in range(1, len(messages)):
        head = tok.encode(tok.apply_chat_template(messages[:k], add_generation_prompt=False))
        assert full[: len(head)] == head


def test_chat_template_text() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|end|>\n")


def test_developer_role_renders_as_system() -> None:
    assert tok.apply_chat_template([{"role": "developer", "content": "x"}], False) == (
        "<|system|>\nx<|end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        pytest.param([{"role": "wizard", "content": "x"}], "unsupported message role", id="role"),
        pytest.param([{"role": "user", "content": 5}], "must be a string or a list", id="content"),
        pytest.param(["hello"], "must be an object", id="not-an-object"),
    ],
)
def test_bad_messages_raise_value_error(messages: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tok.apply_chat_template(messages)


def test_stream_decoder_handles_split_characters() -> None:
    ids = tok.encode("é\U0001f600")  # "é" is one 2-byte chunk; the emoji's 4 bytes are 3 + 1
    assert len(ids) == 3
    decoder = tok.BuiltinTokenizer().stream_decoder()
    assert [decoder.push(i) for i in ids] == ["é", "", "\U0001f600"]


def test_ids_stay_below_vocab_size() -> None:
    ids = tok.encode("\U0010ffff" * 3 + "x" * 10)
    assert all(0 <= i < tok.VOCAB_SIZE for i in ids)
    assert tok.VOCAB_SIZE < 2**31
