"""Long-running streaming requests that hold an engine in a known state until closed.

A request is written on a raw socket and never read, so the test decides when it
ends: closing the socket makes vLLM abort it. With `ignore_eos` and a large
`max_tokens` the engine keeps it running (or waiting) for as long as the test needs.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit


class Inflight:
    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        parts = urlsplit(url)
        assert parts.hostname and parts.port
        payload = json.dumps({**body, "stream": True}).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        self.sock.sendall(head + payload)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def long_completion(model: str, prompt: str, tokens: int = 1800) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


@contextlib.contextmanager
def inflight(url: str, bodies: list[dict[str, Any]]) -> Iterator[list[Inflight]]:
    requests: list[Inflight] = []
    try:
        for body in bodies:
            requests.append(Inflight(url, "/v1/completions", body))
        yield requests
    finally:
        for request in requests:
            request.close()


def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1
) -> float:
    """Seconds until `condition()` held; AssertionError naming `what` after `timeout_s`."""
    started = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
