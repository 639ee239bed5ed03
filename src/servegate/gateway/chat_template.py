"""Chat messages to one prompt string, for engines that take text only (Triton).

An OpenAI chat request reaches Triton's `generate` as `text_input`, so the
gateway renders the messages itself, the way vLLM would: a Jinja chat template
in a sandbox (`ImmutableSandboxedEnvironment`, as HuggingFace does) with
`messages`, `add_generation_prompt`, the tokenizer's special tokens, `tools`,
`documents` and `chat_template_kwargs`. Where the template comes from, first
found wins:

1. the model declaration's `chat_template`: inline Jinja (it contains `{{` or
   `{%`), else a file path (relative to the config file's folder);
2. the model's tokenizer folder: `chat_template` in `tokenizer_config.json`
   (a string, or the `default` entry of a list), `chat_template.jinja`,
   `chat_template.json`;
3. ChatML (`<|im_start|>role\\ncontent<|im_end|>`), which many models share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """A template cannot be loaded or rendered; the message says which and why."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def message_text(content: Any) -> str:
    """A message's `content` as text: a string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ChatTemplateError("only text content parts can be sent to this model")
        return "\n".join(parts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


class ChatTemplate:
    """One compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> str:
        if not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        prepared = []
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ChatTemplateError("every message needs a string 'role'")
            out = dict(message)
            out["content"] = message_text(message.get("content"))
            prepared.append(out)
        kwargs = body.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, dict) else {}
        for key in ("tools", "documents"):
            if body.get(key) is not None:
                extra[key] = body[key]
        try:
            return str(
                self._template.render(
                    messages=prepared,
                    add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                    **self.special_tokens,
                    **extra,
                )
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


def _folder_template(folder: Path) -> ChatTemplate | None:
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        loaded = json.loads(config_file.read_text())
        config = loaded if isinstance(loaded, dict) else {}
    special = {k: v for k in SPECIAL_TOKENS if (v := _token_str(config.get(k))) is not None}
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        source = None
        jinja_file = folder / "chat_template.jinja"
        json_file = folder / "chat_template.json"
        if jinja_file.is_file():
            source = jinja_file.read_text()
        elif json_file.is_file():
            doc = json.loads(json_file.read_text())
            value = doc.get("chat_template") if isinstance(doc, dict) else None
            source = value if isinstance(value, str) else None
    return None if source is None else ChatTemplate(source, special)


def load_chat_template(
    declared: str | None = None,
    tokenizer_path: str | None = None,
    config_dir: Path | None = None,
) -> ChatTemplate:
    """The template for one model (see the module docstring for the order)."""
    if declared is not None:
        if "{{" in declared or "{%" in declared:
            return ChatTemplate(declared)
        path = Path(declared)
        if not path.is_absolute() and config_dir is not None:
            path = config_dir / path
        if not path.is_file():
            raise ChatTemplateError(
                f"chat_template {declared!r} is neither Jinja nor a readable file"
            )
        return ChatTemplate(path.read_text())
    if tokenizer_path is not None:
        folder = Path(tokenizer_path)
        if folder.is_file():
            folder = folder.parent
        try:
            found = _folder_template(folder)
        except (OSError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"tokenizer folder {tokenizer_path!r}: {exc}") from exc
        if found is not None:
            return found
    return ChatTemplate(CHATML)
