"""A HuggingFace tokenizer folder behind the simulator's Tokenizer protocol (needs `tokenizers`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servegate.simulator import tokenizer as builtin
from servegate.simulator.hf_tokenizer import HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def build(folder: Path, template: str | None) -> Path:
    models, pre, trainers = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cache holds the prefix of the prompt"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_encode_decode_match_the_library(tmp_path: Path) -> None:
    build(tmp_path, None)
    hf = builtin.load_tokenizer(str(tmp_path))
    assert isinstance(hf, HFTokenizer)
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "the cache holds the prefix"
    assert hf.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert hf.decode(hf.encode(text)) == text
    assert hf.eos_token_id == reference.token_to_id("</s>")


def test_stream_decoder_reassembles_text(tmp_path: Path) -> None:
    hf = HFTokenizer.from_folder(str(build(tmp_path, None)))
    ids = hf.encode("the prompt holds the cache")
    decoder = hf.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) == "the prompt holds the cache"


def test_folder_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    hf = HFTokenizer.from_folder(str(build(tmp_path, TEMPLATE)))
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s><|assistant|>\n"


def test_without_a_template_the_builtin_format_is_used(tmp_path: Path) -> None:
    hf = HFTokenizer.from_folder(str(build(tmp_path, None)))
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages) == builtin.apply_chat_template(messages)
