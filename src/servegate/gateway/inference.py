"""One inference request on a data plane that carries bodies, from arrival to accounting.

aiohttp's handlers (`app.py`) and the ASGI adapter (`integrations/asgi_gateway.py`) differ
only in how they read the body and where the answer goes (their `ClientSink`); the rest
is here, once: the `Director` routes, the proxy (or the P/D forwarder) relays, and the
Director accounts for the request however it ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from multidict import MultiMapping

from servegate.config import GatewaySettings
from servegate.control.director import DISAGG_KINDS, Director, Parser
from servegate.control.errors import GatewayError, InternalError, describe
from servegate.control.sink import ClientSink, send_error
from servegate.gateway.headers import subset_of
from servegate.gateway.parse import parse_request
from servegate.gateway.proxy import forward_headers
from servegate.scheduling.request import RequestKind

log = logging.getLogger("servegate.gateway")

BodyReader = Callable[[GatewaySettings], Awaitable[bytes]]
"""Reads the request body under the settings' size and time limits; raises `BodyTooLarge`,
`RequestTimeout` or `BadRequest`."""
REQUEST_ID_CHARS = 128
IDS_PER_READ = 256


class RandomIds:
    """New request ids: 16 bytes from `os.urandom` each, read 256 ids at a time.

    Why: each `os.urandom` is a `getrandom` system call, ~2 % of a JSON request's CPU in a
    native profile when made per request. The ids stay unpredictable (the same kernel
    source); a forked child starts from fresh bytes, so that workers never share ids."""

    __slots__ = ("_at", "_hex")

    def __init__(self) -> None:
        self._hex = ""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._hex):
            self._hex = os.urandom(16 * IDS_PER_READ).hex()
            at = 0
        self._at = at + 32
        return self._hex[at : at + 32]

    def forget(self) -> None:
        """Drop the bytes not yet handed out (after a fork they are the parent's too)."""
        self._hex = ""
        self._at = 0


IDS = RandomIds()
os.register_at_fork(after_in_child=IDS.forget)


def request_id(headers: MultiMapping[str]) -> str:
    """The client's `X-Request-ID` when it is short and printable, else a new one."""
    rid = headers.get("X-Request-ID")
    if rid and len(rid) <= REQUEST_ID_CHARS and rid.isprintable():
        return rid
    return IDS.next()


async def serve_inference(
    director: Director,
    sink: ClientSink,
    kind: RequestKind,
    method: str,
    path: str,
    headers: MultiMapping[str],
    read_body: BodyReader,
    parse: Parser = parse_request,
) -> GatewayError | None:
    """Route and relay one request, answering through `sink`; returns the error it answered
    with, if any (the adapter may close the connection after some). A `CancelledError`
    (the adapter's sign that the client left) and an unexpected failure after the answer
    began propagate."""
    started = time.monotonic()
    lowered = {k.lower(): v for k, v in headers.items()}
    ctx = director.begin(request_id(headers), method, path, lowered, started)
    try:
        director.authorise(ctx)
        body = await read_body(ctx.snapshot.config.gateway)
        runtime, decision = await director.route(ctx, body, kind, subset_of(lowered), parse)
        upstream_headers = forward_headers(
            headers,
            ctx.request_id,
            strip_authorization=ctx.snapshot.tenants.enabled,
            client=sink.remote,
        )
        if ctx.upstream_headers:
            upstream_headers.update(ctx.upstream_headers)
        if kind in DISAGG_KINDS and runtime.disagg.handles(decision):
            await runtime.disagg.forward(sink, ctx, upstream_headers)
        else:
            await runtime.proxy.forward(sink, ctx, upstream_headers)
        director.complete(ctx)
        return None
    except GatewayError as exc:
        director.fail(ctx, exc)
        if sink.started:
            sink.abort()
        else:
            await send_error(sink, exc, {"X-Request-ID": ctx.request_id})
        return exc
    except ConnectionResetError:
        # The client left before the answer began (an ASGI host's `http.disconnect`
        # while the body arrived): nobody to answer; `finish` accounts a 499.
        return None
    except asyncio.CancelledError:
        ctx.record.status = 499
        ctx.record.error = "client disconnected"
        raise
    except Exception as exc:
        if sink.started:
            ctx.record.error = describe(exc)
            raise  # the answer has begun: only a cut connection can say it failed
        log.exception("unexpected error on request %s", ctx.request_id)
        error = InternalError(f"the gateway failed: {describe(exc)}")
        director.fail(ctx, error)
        ctx.record.error = describe(exc)
        await send_error(sink, error, {"X-Request-ID": ctx.request_id})
        return error
    finally:
        director.finish(ctx)
