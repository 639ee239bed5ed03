"""Rewriting one generated section of a markdown file between HTML-comment markers.

    <!-- standard-comparison:start -->
    ...generated...
    <!-- standard-comparison:end -->

Only the text between the markers changes; a file without the markers gets the
section appended. A file with only one of the two, or with them out of order,
is an error rather than a guess.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(document: str, name: str, body: str) -> str:
    start, end = markers(name)
    block = f"{start}\n{body.strip()}\n{end}"
    first, last = document.find(start), document.find(end)
    if first < 0 and last < 0:
        head = document.rstrip("\n")
        return (head + "\n\n" if head else "") + block + "\n"
    if first < 0 or last < 0 or last < first:
        raise ValueError(
            f"the markers {start} and {end} must both appear, start before end; "
            "fix them by hand or delete both to append a fresh section"
        )
    return document[:first] + block + document[last + len(end) :]


def update_file(path: Path, name: str, body: str) -> None:
    document = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(replace_section(document, name, body), encoding="utf-8")
