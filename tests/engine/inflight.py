"""Long adapter requests that put a real vLLM server in a known state, and take it out again.

A state such as "a1 and a2 running, a3 waiting for a LoRA slot" cannot be held by
timing: on a busy 2-core machine the API process can take 10 s to admit the second
of two requests and 8 s to answer `/metrics`, while a request decodes its whole
budget in a few seconds. So `holding` sets the state up with the engine paused
(`POST /pause?mode=keep` freezes the scheduler and its stats; a dev-mode route),
lets it run only until `/metrics` shows the wanted counts, and freezes it there.
On exit it aborts every request in the engine (`POST /abort_requests`) and waits
for an idle page: closing a never-read stream does not reliably abort the request,
because vLLM only notices the disconnect when the API process gets to it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.vllm_cluster import VllmServer, http_request

QUEUE_S = 0.5
"""Engine time given to requests that should end up waiting (no LoRA slot for them)."""
FROZEN_S = 10.0
"""How long a paused engine's `/metrics` may take to show its frozen state."""
HOLD_TOKENS = 2000
"""Decode budget of a holding request: the tiny model's 2048-token context, less the prompt."""


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

    def accepted(self, timeout_s: float = 60.0) -> None:
        """Wait for the response head: the API process has handed the request to the engine."""
        self.sock.settimeout(timeout_s)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise AssertionError(f"the server closed the stream before answering: {head!r}")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status + b" ":
            raise AssertionError(f"the server refused a holding request: {head[:500]!r}")
        self.body = head.split(b"\r\n\r\n", 1)[1]

    def first_token(self, timeout_s: float = 60.0) -> None:
        """Wait for the stream's first event: the engine has scheduled the request."""
        self.sock.settimeout(timeout_s)
        while b"data:" not in self.body:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise AssertionError("the server closed a holding stream before its first token")
            self.body += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def long_completion(model: str, prompt: str, tokens: int = HOLD_TOKENS) -> dict[str, Any]:
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


def engine_counts(server: VllmServer) -> tuple[float, float]:
    """(running, waiting) on the engine's `/metrics` page."""
    families = {f.name: f for f in text_string_to_metric_families(server.metrics_text())}

    def total(name: str) -> float:
        return sum(s.value for s in families[name].samples)

    return total("vllm:num_requests_running"), total("vllm:num_requests_waiting")


def _control(server: VllmServer, path: str, body: bytes = b"") -> None:
    headers = {"Content-Type": "application/json"}
    status, _, raw = http_request(f"{server.url}{path}", body, method="POST", headers=headers)
    if status != 200:
        raise RuntimeError(f"POST {server.url}{path} answered {status}: {raw[:300]!r}")


def pause(server: VllmServer) -> None:
    """Freeze the scheduler with its requests in place; `/metrics` keeps the last step's state."""
    _control(server, "/pause?mode=keep")


def resume(server: VllmServer) -> None:
    _control(server, "/resume")


def settle(server: VllmServer, timeout_s: float = 60.0) -> None:
    """Abort whatever the engine runs, resume it, and wait for an idle page."""
    _control(server, "/abort_requests", b"{}")
    resume(server)
    wait_for(
        lambda: engine_counts(server) == (0.0, 0.0),
        timeout_s=timeout_s,
        what=f"{server.url} idle",
    )


class HoldLost(AssertionError):
    """The engine moved past the wanted state before it could be frozen."""


def _admit(
    server: VllmServer,
    requests: list[Inflight],
    bodies: list[dict[str, Any]],
    want: tuple[float, float],
    timeout_s: float,
    *,
    run: bool,
) -> None:
    """With the engine paused: send `bodies`, let the engine run until they are in place,
    pause again, then wait for the frozen page to show `want`.

    The pause comes from the streams themselves, not from `/metrics`: when the engine
    decodes fast, the API process is busy relaying tokens and answers `/metrics` seconds
    late, so a state read there was already gone when the pause landed (a quiet machine
    failed this three attempts in a row). Requests that should run (`run`) are in place
    at their first token; requests that should wait get `QUEUE_S` of engine steps. Once
    paused the page stops moving, so reading it late is harmless."""
    sent: list[Inflight] = []
    for body in bodies:
        requests.append(Inflight(server.url, "/v1/completions", body))
        sent.append(requests[-1])
        requests[-1].accepted(timeout_s)
    resume(server)
    try:
        if run:
            for request in sent:
                request.first_token(timeout_s)
        else:
            time.sleep(QUEUE_S)
    except (AssertionError, OSError) as exc:
        raise HoldLost(f"{server.url}: {exc}") from exc
    finally:
        pause(server)
    try:
        wait_for(lambda: engine_counts(server) == want, FROZEN_S, f"{want} on {server.url}")
    except AssertionError as exc:
        seen = engine_counts(server)
        raise HoldLost(f"{server.url} froze at (running, waiting) {seen}, not {want}") from exc


@contextlib.contextmanager
def holding(
    server: VllmServer,
    running: Sequence[str],
    waiting: Sequence[str] = (),
    *,
    attempts: int = 3,
    timeout_s: float = 60.0,
) -> Iterator[None]:
    """`server` paused with one long request per adapter in `running` running and per
    adapter in `waiting` waiting (they must find no free LoRA slot). On exit every
    request is aborted and the server is idle and running again.

    Inside, `resume(server)` lets the state run on (it then ends when the requests
    finish, after at least HOLD_TOKENS decode steps).
    """
    failures: list[str] = []
    for _ in range(attempts):
        requests: list[Inflight] = []
        settle(server, timeout_s)
        try:
            pause(server)
            try:
                bodies = [long_completion(a, f"hold {a} running") for a in running]
                _admit(server, requests, bodies, (float(len(running)), 0.0), timeout_s, run=True)
                if waiting:
                    bodies = [long_completion(a, f"hold {a} waiting") for a in waiting]
                    want = (float(len(running)), float(len(waiting)))
                    _admit(server, requests, bodies, want, timeout_s, run=False)
            except HoldLost as exc:
                failures.append(str(exc))
                continue
            yield
            return
        finally:
            settle(server, timeout_s)
            for request in requests:
                request.close()
    raise AssertionError(f"could not hold {server.url} in the wanted state: {failures}")
