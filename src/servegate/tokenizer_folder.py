"""A HuggingFace tokenizer folder's chat template and special tokens, read and rendered like vLLM.

Two parts of servegate render these templates: routing tokenisation
(`tokenization/sources.py`, whose ids must equal the engine's) and the Triton
translation (`gateway/chat_template.py`, whose text is the prompt the engine gets).
They must find the same template, pass the same variables and render in the same
sandbox, so both take those from here. jinja2 is imported only when a sandbox is
made: routing without an `hf` tokenizer never imports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def read_config(folder: Path) -> dict[str, Any]:
    """`tokenizer_config.json` in `folder`, {} without one; raises `OSError` or `ValueError`."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    loaded = json.loads(config_file.read_text())
    return loaded if isinstance(loaded, dict) else {}


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a template may refer to (`{{ bos_token }}`), as strings."""
    return {k: v for k in SPECIAL_TOKENS if (v := _token_str(config.get(k))) is not None}


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template` of the config (a string, or the `default` of a list), else
    `chat_template.jinja`, else `chat_template.json`; None when the folder has none."""
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str):
        return source
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        doc = json.loads(json_file.read_text())
        value = doc.get("chat_template") if isinstance(doc, dict) else None
        return value if isinstance(value, str) else None
    return None


def sandbox(error: type[Exception]) -> ImmutableSandboxedEnvironment:
    """HuggingFace's template sandbox; `raise_exception(...)` in a template raises `error`.

    Raises `ImportError` without jinja2.
    """
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise error(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def add_generation_prompt(body: Mapping[str, Any]) -> bool:
    return body.get("add_generation_prompt", True) is not False


def template_extras(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's own template variables: `chat_template_kwargs`, `tools`, `documents`."""
    kwargs = body.get("chat_template_kwargs")
    extra = dict(kwargs) if isinstance(kwargs, dict) else {}
    for key in ("tools", "documents"):
        if body.get(key) is not None:
            extra[key] = body[key]
    return extra
