"""Rewriting the generated section of a markdown file between its markers."""

from __future__ import annotations

from pathlib import Path

import pytest

from servegate.bench.docs_section import replace_section, update_file

START, END = "<!-- demo:start -->", "<!-- demo:end -->"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        pytest.param(
            "# Bench\n\nintro\n",
            f"# Bench\n\nintro\n\n{START}\nnew\n{END}\n",
            id="no-markers-appends",
        ),
        pytest.param(
            f"# Bench\n{START}\nold\nlines\n{END}\n## After\nkept\n",
            f"# Bench\n{START}\nnew\n{END}\n## After\nkept\n",
            id="replaces-only-between-markers",
        ),
        pytest.param("", f"{START}\nnew\n{END}\n", id="empty-file"),
    ],
)
def test_replace_section(document: str, expected: str) -> None:
    assert replace_section(document, "demo", "\nnew\n\n") == expected


def test_replace_section_is_idempotent() -> None:
    once = replace_section("# Bench\n", "demo", "table")
    assert replace_section(once, "demo", "table") == once


@pytest.mark.parametrize(
    "document",
    [
        pytest.param(f"text\n{START}\nno end\n", id="start-only"),
        pytest.param(f"text\n{END}\nno start\n", id="end-only"),
        pytest.param(f"{END}\nreversed\n{START}\n", id="reversed"),
    ],
)
def test_broken_markers_are_an_error(document: str) -> None:
    with pytest.raises(ValueError, match="must both appear, start before end"):
        replace_section(document, "demo", "new")


def test_update_file_creates_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "bench.md"
    update_file(path, "demo", "body")
    assert path.read_text() == f"{START}\nbody\n{END}\n"
