from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from servegate.bench.trace import TraceError, read_trace, write_trace
from servegate.bench.workloads import (
    Api,
    BenchRequest,
    ChatMessage,
    MultiTurnWorkload,
    SharedPrefixWorkload,
    with_poisson_timestamps,
)


@pytest.mark.parametrize(
    "requests",
    [
        pytest.param(
            with_poisson_timestamps(
                SharedPrefixWorkload(num_groups=2, prompts_per_group=3).generate(
                    model="m", api=Api.COMPLETIONS, seed=1
                ),
                rate=4.0,
                seed=1,
            ),
            id="shared-prefix-completions-with-timestamps",
        ),
        pytest.param(
            MultiTurnWorkload(sessions=2, turns=2).generate(model="m", api=Api.CHAT, seed=2),
            id="multi-turn-chat-with-headers",
        ),
    ],
)
def test_round_trip(tmp_path: Path, requests: list[BenchRequest]) -> None:
    path = tmp_path / "trace.jsonl"
    assert write_trace(path, requests) == len(requests)
    assert read_trace(path) == requests


def test_reads_the_documented_example(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0.0, "model": "tiny", "max_tokens": 32, "prompt": "ka lo mi"}\n'
        "\n"
        '{"timestamp": 0.41, "model": "tiny", "max_tokens": 16, '
        '"messages": [{"role": "user", "content": "ka lo"}], "headers": {"x-session-id": "s1"}}\n'
    )
    first, second = read_trace(path)
    assert first == BenchRequest("tiny", 32, prompt="ka lo mi")
    assert second == BenchRequest(
        "tiny",
        16,
        messages=(ChatMessage("user", "ka lo"),),
        headers={"x-session-id": "s1"},
        timestamp=0.41,
    )


BASE = {"timestamp": 0, "model": "m", "max_tokens": 3}


def line(**fields: object) -> str:
    return orjson.dumps({**BASE, **fields}).decode()


USER = [{"role": "user", "content": "c"}]


@pytest.mark.parametrize(
    ("line_", "message"),
    [
        pytest.param(line(prompt="p", temp=1), "unknown key", id="unknown-key"),
        pytest.param('{"model": "m", "max_tokens": 3, "prompt": "p"}', "missing", id="missing"),
        pytest.param(line(), "exactly one", id="no-prompt"),
        pytest.param(line(prompt="p", messages=USER), "exactly one", id="both"),
        pytest.param(line(messages=[{"role": "user"}]), "messages", id="bad-message"),
        pytest.param(line(messages=[]), "non-empty", id="empty-messages"),
        pytest.param(line(prompt="p", timestamp=-1), "timestamp", id="negative-timestamp"),
        pytest.param(line(prompt="p", max_tokens=True), "max_tokens", id="bool-max-tokens"),
        pytest.param(line(prompt=5), "prompt", id="prompt-not-string"),
        pytest.param(line(prompt="p", headers={"a": 1}), "headers", id="headers"),
        pytest.param("[1, 2]", "JSON object", id="not-object"),
        pytest.param("{not json", "not valid JSON", id="bad-json"),
    ],
)
def test_bad_lines_name_file_line_and_problem(tmp_path: Path, line_: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line(prompt="ok") + "\n" + line_)
    with pytest.raises(TraceError, match=message) as caught:
        read_trace(path)
    assert f"{path}:2:" in str(caught.value)


def test_empty_trace_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)
