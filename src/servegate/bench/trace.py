"""Recorded request traces: JSONL, one request a line, read strictly.

A line is an object with `timestamp` (seconds from the trace start), `model`,
`max_tokens`, exactly one of `prompt` (string) or `messages` (list of
`{"role", "content"}`), and optionally `headers` (string to string; `x-session-id`
marks a multi-turn session, whose lines are replayed in file order). Unknown keys
are errors that name the file and line, so a typo cannot silently change a run.

    {"timestamp": 0.0, "model": "tiny", "max_tokens": 32, "prompt": "ka lo mi"}
    {"timestamp": 0.41, "model": "tiny", "max_tokens": 16,
     "messages": [{"role": "user", "content": "ka lo"}], "headers": {"x-session-id": "s1"}}
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from servegate.bench.workloads import BenchRequest, ChatMessage

REQUIRED_KEYS = frozenset({"timestamp", "model", "max_tokens"})
ALLOWED_KEYS = REQUIRED_KEYS | {"prompt", "messages", "headers"}


class TraceError(ValueError):
    """A trace line that does not match the format; the message says where and why."""


def request_to_record(request: BenchRequest) -> dict[str, Any]:
    record: dict[str, Any] = {
        "timestamp": request.timestamp,
        "model": request.model,
        "max_tokens": request.max_tokens,
    }
    if request.prompt is not None:
        record["prompt"] = request.prompt
    else:
        messages = request.messages or ()
        record["messages"] = [{"role": m.role, "content": m.content} for m in messages]
    if request.headers:
        record["headers"] = dict(request.headers)
    return record


def write_trace(path: Path, requests: Iterable[BenchRequest]) -> int:
    """Writes one line per request; returns how many were written."""
    count = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        for request in requests:
            handle.write(orjson.dumps(request_to_record(request)) + b"\n")
            count += 1
    return count


def _messages(value: Any, where: str) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise TraceError(f"{where}: `messages` must be a non-empty list")
    messages = []
    for index, item in enumerate(value):
        if (
            not isinstance(item, dict)
            or set(item) != {"role", "content"}
            or not isinstance(item["role"], str)
            or not isinstance(item["content"], str)
        ):
            raise TraceError(f'{where}: messages[{index}] must be {{"role": str, "content": str}}')
        messages.append(ChatMessage(item["role"], item["content"]))
    return tuple(messages)


def record_to_request(record: Any, where: str) -> BenchRequest:
    if not isinstance(record, dict):
        raise TraceError(f"{where}: a trace line must be a JSON object")
    unknown = set(record) - ALLOWED_KEYS
    if unknown:
        raise TraceError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(ALLOWED_KEYS)}"
        )
    missing = REQUIRED_KEYS - set(record)
    if missing:
        raise TraceError(f"{where}: missing key(s) {sorted(missing)}")
    timestamp, model, max_tokens = record["timestamp"], record["model"], record["max_tokens"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"{where}: `timestamp` must be a number >= 0, got {timestamp!r}")
    if not isinstance(model, str) or not model:
        raise TraceError(f"{where}: `model` must be a non-empty string")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise TraceError(f"{where}: `max_tokens` must be an integer >= 1, got {max_tokens!r}")
    if ("prompt" in record) == ("messages" in record):
        raise TraceError(f"{where}: give exactly one of `prompt` or `messages`")
    prompt = record.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError(f"{where}: `prompt` must be a string")
    messages = _messages(record["messages"], where) if "messages" in record else None
    headers = record.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise TraceError(f"{where}: `headers` must map strings to strings")
    return BenchRequest(
        model=model,
        max_tokens=max_tokens,
        prompt=prompt,
        messages=messages,
        headers=headers,
        timestamp=float(timestamp),
    )


def read_trace(path: Path) -> list[BenchRequest]:
    """Every request of a JSONL trace, in file order; blank lines are skipped."""
    requests = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc})") from exc
            requests.append(record_to_request(record, where))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return requests
