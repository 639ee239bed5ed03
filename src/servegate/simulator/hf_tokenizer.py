"""A HuggingFace tokenizer folder behind the simulator's `Tokenizer` protocol.

Needs the `tokenizers` package (and `jinja2` for the folder's own chat
template, from `tokenizer_config.json` or `chat_template.jinja`; without it, or
without a template, the built-in template format of `tokenizer.py` is used). The
same folder given to real vLLM and to the router yields the same token ids, so
precise prefix routing can be compared: like vLLM, a completion prompt gets the
tokenizer's special tokens (BOS) and a rendered chat template does not.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servegate.simulator import tokenizer as builtin


class HFTokenizer:
    def __init__(
        self,
        tok: Any,
        name: str,
        eos_token_id: int,
        chat_template: str | None,
        special: dict[str, str],
    ) -> None:
        self._tok = tok
        self.name = name
        self.eos_token_id = eos_token_id
        self._special = special
        self._template: Any = None
        if chat_template:
            try:
                jinja2 = importlib.import_module("jinja2")
            except ImportError:
                self._template = None
            else:
                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                self._template = env.from_string(chat_template)
        vocab = tok.get_vocab_size()
        self._output_ids = tuple(range(min(100, vocab // 2), vocab))

    @classmethod
    def from_folder(cls, path: str) -> HFTokenizer:
        try:
            rust_tokenizer = importlib.import_module("tokenizers").Tokenizer
        except ImportError as exc:
            raise RuntimeError(
                "tokenizer.path needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise RuntimeError(f"no tokenizer.json in {path}")
        tok = rust_tokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        special = {
            key: _token_str(config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if _token_str(config.get(key))
        }
        eos = special.get("eos_token")
        eos_id = tok.token_to_id(eos) if eos else None
        template = config.get("chat_template")
        template_file = file.parent / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        return cls(
            tok,
            name=str(folder),
            eos_token_id=eos_id if isinstance(eos_id, int) else 0,
            chat_template=template if isinstance(template, str) else None,
            special=special,
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            return builtin.apply_chat_template(messages, add_generation_prompt)
        return str(
            self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        )

    def output_token_ids(self) -> Sequence[int]:
        return self._output_ids

    def stream_decoder(self) -> builtin.StreamDecoder:
        return _HFStreamDecoder(self)


class _HFStreamDecoder:
    """Decodes the growing output and returns the new complete characters."""

    __slots__ = ("_ids", "_sent", "_tok")

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        full = self._tok.decode(self._ids)
        if full.endswith("\ufffd"):
            return ""
        new = full[self._sent :]
        self._sent = len(full)
        return new


def _token_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_tokenizer(path: str | None) -> builtin.Tokenizer:
    """The built-in tokenizer, or the HuggingFace one in folder `path`.

    Here rather than in `tokenizer.py` so that the built-in module never imports this one.
    """
    if path is None:
        return builtin.BuiltinTokenizer()
    return HFTokenizer.from_folder(path)
