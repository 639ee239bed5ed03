"""The HTTP rendering of the errors a client can see (the types live in `control/errors.py`).

The error classes are data-plane neutral so that the ext_proc picker maps the same ones;
they are re-exported here because the HTTP side names them from this module. `render` is
the one place that writes an error as an aiohttp response.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

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
    error_body,
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
    headers = dict(exc.headers)
    headers.update(exc.extra_headers)
    if extra_headers:
        headers.update(extra_headers)
    return web.Response(
        status=exc.status,
        body=error_body(exc.message, exc.type, exc.code, exc.param),
        content_type="application/json",
        headers=headers,
    )
