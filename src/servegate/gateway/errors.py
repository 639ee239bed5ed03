"""The HTTP rendering of the errors a client can see (the types live in `control/errors.py`).

The error classes are data-plane neutral so that the ext_proc picker maps the same ones;
they are re-exported here because the HTTP side names them from this module. `render` is
an error as an aiohttp response, for the routes that answer without a `ClientSink`
(`/v1/models`, admin, aiohttp's own 404 and 405); it writes the same headers and body as
`control/sink.py`'s `send_error`.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from multidict import CIMultiDict

from servegate.control.errors import (
    DESCRIBE_CHARS,
    DROPPED_REASON_HEADER,
    ECHO_CHARS,
    TYPE_BY_STATUS,
    BadRequest,
    BodyTooLarge,
    Dropped,
    Forbidden,
    GatewayError,
    InternalError,
    ModelNotFound,
    NoEndpoints,
    NotFound,
    RequestTimeout,
    Saturated,
    ShuttingDown,
    TtlExpired,
    Unauthorized,
    UpstreamFailed,
    UpstreamTimeout,
    clip,
    describe,
    error_answer,
    error_body,
    error_headers,
    for_status,
    sse_error_event,
)

__all__ = [
    "DESCRIBE_CHARS",
    "DROPPED_REASON_HEADER",
    "ECHO_CHARS",
    "TYPE_BY_STATUS",
    "BadRequest",
    "BodyTooLarge",
    "Dropped",
    "Forbidden",
    "GatewayError",
    "InternalError",
    "ModelNotFound",
    "NoEndpoints",
    "NotFound",
    "RequestTimeout",
    "Saturated",
    "ShuttingDown",
    "TtlExpired",
    "Unauthorized",
    "UpstreamFailed",
    "UpstreamTimeout",
    "clip",
    "describe",
    "error_body",
    "for_status",
    "render",
    "sse_error_event",
]


def render(exc: GatewayError, extra_headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=exc.status,
        body=error_answer(exc),
        headers=CIMultiDict(error_headers(exc, extra_headers)),
    )
