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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from servegate import tokenizer_folder as hf_folder

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template cannot be loaded or rendered; the message says which and why."""


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
            self._template = hf_folder.sandbox(ChatTemplateError).from_string(source)
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
        try:
            return str(
                self._template.render(
                    messages=prepared,
                    add_generation_prompt=hf_folder.add_generation_prompt(body),
                    **self.special_tokens,
                    **hf_folder.template_extras(body),
                )
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


def _folder_template(folder: Path) -> ChatTemplate | None:
    config = hf_folder.read_config(folder)
    source = hf_folder.template_source(folder, config)
    return None if source is None else ChatTemplate(source, hf_folder.special_tokens(config))


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
