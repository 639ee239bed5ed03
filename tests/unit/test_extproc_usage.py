"""Usage read beside a relayed response."""

from __future__ import annotations

import orjson
import pytest

from servegate.extproc import usage as usage_module
from servegate.extproc.usage import UsageTap

SSE = [
    b'data: {"choices":[{"delta":{"content":"hello"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,',
    b'"prompt_tokens_details":{"cached_tokens":8}}}\n\ndata: [DONE]\n\n',
]
JSON = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})


@pytest.mark.parametrize(
    ("streaming", "parts", "expected"),
    [
        pytest.param(True, SSE, (9, 3, 8), id="sse-split-usage-chunk"),
        pytest.param(False, [JSON[:5], JSON[5:]], (2, 1, None), id="json-in-two-chunks"),
        pytest.param(False, [b'{"choices": []}'], None, id="json-without-usage"),
        pytest.param(False, [b'{"usage": {'], None, id="truncated-json"),
        pytest.param(True, [b"data: [DONE]\n\n"], None, id="sse-without-usage"),
    ],
)
def test_usage_tap(
    streaming: bool, parts: list[bytes], expected: tuple[int, int, int | None] | None
) -> None:
    tap = UsageTap(streaming)
    for part in parts:
        tap.feed(part)
    usage = tap.usage()
    got = None if usage is None else (usage.prompt_tokens, usage.completion_tokens,
                                        usage.cached_tokens)  # fmt: skip
    assert got == expected


def test_a_json_body_over_the_limit_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_module, "JSON_LIMIT", len(JSON) - 1)
    tap = UsageTap(False)
    tap.feed(JSON[:10])
    tap.feed(JSON[10:])
    assert tap.usage() is None


def test_the_sse_tail_is_bounded() -> None:
    tap = UsageTap(True)
    for _ in range(100):
        tap.feed(b"data: " + b"x" * 1000 + b"\n\n")
    tap.feed(SSE[1] + SSE[2])
    usage = tap.usage()
    assert usage is not None
    assert usage.completion_tokens == 3
    assert len(tap._buffer) <= usage_module.TAIL_BYTES + len(SSE[1] + SSE[2])
