"""A small real HuggingFace tokenizer folder, trained on the spot (no model hub needed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def write_hf_folder(folder: Path, corpus: Sequence[str], vocab_size: int = 400) -> Path:
    """`tokenizer.json` (byte-level BPE whose post-processor prepends `<s>`),
    `tokenizer_config.json` and `chat_template.jinja` in `folder`; skips without
    `tokenizers`."""
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder
