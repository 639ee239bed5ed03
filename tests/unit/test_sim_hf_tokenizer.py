"""A HuggingFace tokenizer folder behind the simulator's Tokenizer protocol (needs `tokenizers`)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from servegate.simulator import tokenizer as builtin
from servegate.simulator.hf_tokenizer import HFTokenizer, load_tokenizer
from servegate.testing.cluster import SimCluster

tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def build(folder: Path, template: str | None, *, bos: bool = False) -> Path:
    """A small BPE folder; `bos` adds a post-processor that prepends `<s>`, as Llama's."""
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
    if bos:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_encode_decode_match_the_library(tmp_path: Path) -> None:
    build(tmp_path, None)
    hf = load_tokenizer(str(tmp_path))
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


@pytest.mark.parametrize(
    ("add_special_tokens", "starts_with_bos"),
    [(True, True), (False, False)],
    ids=["completion-prompt-gets-bos", "rendered-chat-has-its-own"],
)
def test_special_tokens_as_vllm_adds_them(
    tmp_path: Path, add_special_tokens: bool, starts_with_bos: bool
) -> None:
    hf = HFTokenizer.from_folder(str(build(tmp_path, None, bos=True)))
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "the cache holds the prefix"
    ids = hf.encode(text, add_special_tokens=add_special_tokens)
    assert ids == reference.encode(text, add_special_tokens=add_special_tokens).ids
    assert (ids[0] == reference.token_to_id("<s>")) is starts_with_bos
    # BOS is one token in front of the same ids
    assert len(ids) == len(hf.encode(text)) + starts_with_bos


def test_template_in_chat_template_jinja(tmp_path: Path) -> None:
    """transformers >= 4.43 saves the template in its own file, not in tokenizer_config.json."""
    pytest.importorskip("jinja2")
    build(tmp_path, None)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    hf = HFTokenizer.from_folder(str(tmp_path))
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s><|assistant|>\n"


@pytest.mark.parametrize(
    ("body", "bos_count"),
    [
        ({"prompt": "the cache holds"}, 1),
        ({"prompt": "the cache holds", "add_special_tokens": False}, 0),
        ({"messages": [{"role": "user", "content": "the cache holds"}]}, 1),
        ({"messages": [{"role": "user", "content": "the cache"}], "add_special_tokens": True}, 2),
    ],
    ids=["prompt", "prompt-without", "chat-template-bos-only", "chat-with-extra-bos"],
)
async def test_tokenize_and_completions_count_bos_as_vllm(
    tmp_path: Path, body: dict[str, object], bos_count: int
) -> None:
    pytest.importorskip("jinja2")
    folder = build(tmp_path, TEMPLATE, bos=True)
    bos = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<s>")
    base = {"model": "m", "tokenizer": {"path": str(folder)}, "speed": 100.0}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with SimCluster(1, base=base) as cluster, aiohttp.ClientSession() as http:
        async with http.post(cluster[0].url + "/tokenize", json={"model": "m", **body}) as resp:
            tokens = (await resp.json())["tokens"]
        request = {"model": "m", "max_tokens": 1, **body}
        async with http.post(cluster[0].url + path, json=request) as resp:
            prompt_tokens = (await resp.json())["usage"]["prompt_tokens"]
    assert tokens.count(bos) == bos_count
    assert tokens[:bos_count] == [bos] * bos_count
    assert prompt_tokens == len(tokens)
