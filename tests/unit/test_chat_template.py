from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from servegate.gateway.chat_template import (
    CHATML,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)

USER = [{"role": "user", "content": "hi"}]
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({}, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", id="default"),
        pytest.param(
            {"add_generation_prompt": False}, "<|im_start|>user\nhi<|im_end|>\n", id="no-gen"
        ),
    ],
)
def test_chatml(body: dict[str, Any], expected: str) -> None:
    assert load_chat_template().render(USER, body) == expected


def test_text_parts_are_joined() -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        }
    ]
    assert ChatTemplate("{{ messages[0].content }}").render(messages, {}) == "a\nb"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        pytest.param([], "non-empty", id="empty"),
        pytest.param([{"content": "x"}], "role", id="no-role"),
        pytest.param(
            [{"role": "user", "content": [{"type": "image_url"}]}], "text content", id="image"
        ),
        pytest.param([{"role": "user", "content": 3}], "string", id="number"),
    ],
)
def test_bad_messages(messages: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        load_chat_template().render(messages, {})


def test_raise_exception_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="only user"):
        ChatTemplate("{{ raise_exception('only user') }}").render(USER, {})
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(USER, {})
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")


def test_kwargs_and_tools_reach_the_template() -> None:
    template = ChatTemplate("{{ flavour }}|{{ tools | tojson }}")
    body = {"chat_template_kwargs": {"flavour": "x"}, "tools": [{"n": 1}]}
    assert template.render(USER, body) == 'x|[{"n": 1}]'


def test_declared_inline_wins(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "folder"}))
    assert load_chat_template("{{ 'inline' }}", str(tmp_path)).render(USER, {}) == "inline"


def test_declared_file_relative_to_config(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages | length }}")
    assert load_chat_template("t.jinja", None, tmp_path).render(USER, {}) == "1"
    with pytest.raises(ChatTemplateError, match="neither Jinja nor a readable file"):
        load_chat_template("missing.jinja", None, tmp_path)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"tokenizer_config.json": {"chat_template": LLAMA_LIKE, "bos_token": "<s>"}},
            "<s><user>hi<assistant>",
            id="tokenizer-config",
        ),
        pytest.param(
            {
                "tokenizer_config.json": {
                    "chat_template": [{"name": "default", "template": "{{ 'named' }}"}],
                }
            },
            "named",
            id="named-list",
        ),
        pytest.param(
            {"tokenizer_config.json": {}, "chat_template.jinja": "{{ 'jinja-file' }}"},
            "jinja-file",
            id="jinja-file",
        ),
        pytest.param(
            {"chat_template.json": {"chat_template": "{{ 'json-file' }}"}},
            "json-file",
            id="json-file",
        ),
        pytest.param({}, None, id="none-chatml"),
    ],
)
def test_tokenizer_folder(tmp_path: Path, files: dict[str, Any], expected: str | None) -> None:
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name).write_text(text)
    template = load_chat_template(None, str(tmp_path))
    if expected is None:
        assert template.source == CHATML
    else:
        assert template.render(USER, {}) == expected
