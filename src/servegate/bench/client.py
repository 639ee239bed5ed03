"""One request, sent and timed: TTFT, inter-token gaps per SSE chunk, end-to-end.

Timing starts just before the request is handed to aiohttp and uses
`time.perf_counter`. A streamed chunk counts as output when a choice carries text
(`text`, `delta.content`, `delta.reasoning_content`/`reasoning` or `delta.tool_calls`);
TTFT is the first such chunk and inter-token latencies are the gaps between them.
Output tokens come from `usage.completion_tokens` when the server reports it, else
from the number of output chunks.

A failure never raises: it becomes a result with `error_kind` set to the HTTP status
(`"429"`), or `"connection"`, `"timeout"`, `"stream-error"` (an error event inside a
200 stream) or `"bad-response"` (unparseable JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from servegate.bench.workloads import BenchRequest

SERVED_BY_HEADER = "x-gateway-destination-endpoint"
ERROR_SNIPPET_CHARS = 200
DRAIN_TIMEOUT_S = 1.0
JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class RequestResult:
    started_at: float
    """`time.perf_counter()` when the request was sent."""
    status: int
    """HTTP status; 0 when no response arrived."""
    e2e_s: float
    ttft_s: float | None = None
    """None for non-streamed requests and for streams without any output chunk."""
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens`: prompt tokens served from cache."""
    served_by: str | None = None
    """`x-gateway-destination-endpoint` of the response, when a gateway sets it."""
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


@dataclass(slots=True)
class _Usage:
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_usage(usage: Any, into: _Usage) -> None:
    if not isinstance(usage, dict):
        return
    into.completion_tokens = _int_or_none(usage.get("completion_tokens"))
    into.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        into.cached_tokens = _int_or_none(details.get("cached_tokens"))


def has_output(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            return True
    return False


class _StreamError(Exception):
    pass


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read what follows `[DONE]` (the stream's end) so the connection can be reused.

    Leaving a response unread makes aiohttp close the connection, and every next
    request would then pay a new TCP connection. A server that keeps the stream
    open after `[DONE]` gets its connection closed after `DRAIN_TIMEOUT_S`.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            await response.content.read()


async def _read_stream(
    response: aiohttp.ClientResponse, started: float, usage: _Usage
) -> tuple[float | None, list[float], int]:
    """Returns (TTFT, inter-token gaps, output chunk count)."""
    first: float | None = None
    previous = 0.0
    gaps: list[float] = []
    chunks = 0
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            await _drain(response)
            break
        now = time.perf_counter()
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise _StreamError(f"unparseable SSE data: {payload[:80]!r}") from exc
        if not isinstance(chunk, dict):
            raise _StreamError(f"SSE data is not an object: {payload[:80]!r}")
        if "error" in chunk:
            raise _StreamError(str(chunk["error"])[:ERROR_SNIPPET_CHARS])
        if chunk.get("usage"):
            _read_usage(chunk["usage"], usage)
        if has_output(chunk):
            chunks += 1
            if first is None:
                first = now
            else:
                gaps.append(now - previous)
            previous = now
    ttft = None if first is None else first - started
    return ttft, gaps, chunks


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    request: BenchRequest,
    *,
    stream: bool,
    ignore_eos: bool = False,
    timeout_s: float = 300.0,
) -> RequestResult:
    body = request.body(stream=stream, ignore_eos=ignore_eos)
    headers = {**JSON_HEADERS, **request.headers}
    usage = _Usage()
    started = time.perf_counter()
    status = 0
    served_by: str | None = None
    try:
        async with session.post(
            base_url + request.path,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            status = response.status
            served_by = response.headers.get(SERVED_BY_HEADER)
            if status != 200:
                snippet = (await response.read())[:ERROR_SNIPPET_CHARS].decode(errors="replace")
                return RequestResult(
                    started_at=started,
                    status=status,
                    e2e_s=time.perf_counter() - started,
                    served_by=served_by,
                    error_kind=str(status),
                    error=snippet,
                )
            if stream:
                ttft, gaps, chunks = await _read_stream(response, started, usage)
            else:
                data = orjson.loads(await response.read())
                if not isinstance(data, dict):
                    raise _StreamError("response body is not a JSON object")
                _read_usage(data.get("usage"), usage)
                ttft, gaps, chunks = None, [], 0
    except _StreamError as exc:
        return _failure(started, status, served_by, "stream-error", str(exc))
    except orjson.JSONDecodeError as exc:
        return _failure(started, status, served_by, "bad-response", f"unparseable JSON: {exc}")
    except ValueError as exc:  # aiohttp: an SSE line longer than its read buffer
        return _failure(started, status, served_by, "bad-response", str(exc))
    except TimeoutError:
        return _failure(started, status, served_by, "timeout", f"no answer within {timeout_s} s")
    except (aiohttp.ClientError, OSError) as exc:
        return _failure(started, status, served_by, "connection", f"{type(exc).__name__}: {exc}")
    except asyncio.IncompleteReadError as exc:
        return _failure(started, status, served_by, "connection", f"incomplete read: {exc}")
    completion = usage.completion_tokens
    return RequestResult(
        started_at=started,
        status=status,
        e2e_s=time.perf_counter() - started,
        ttft_s=ttft,
        itl_s=tuple(gaps),
        output_tokens=completion if completion is not None else chunks,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        served_by=served_by,
    )


def _failure(
    started: float, status: int, served_by: str | None, kind: str, message: str
) -> RequestResult:
    return RequestResult(
        started_at=started,
        status=status,
        e2e_s=time.perf_counter() - started,
        served_by=served_by,
        error_kind=kind,
        error=message,
    )
