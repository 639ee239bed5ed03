"""Every error a client can see, rendered in OpenAI's format.

    GatewayError (status, OpenAI type, code, extra headers)
    ├── BadRequest            400 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error
    ├── ModelNotFound         404 invalid_request_error / model_not_found
    ├── NotFound              404 (unknown route)
    ├── BodyTooLarge          413 invalid_request_error
    ├── Dropped               429/503 with x-llm-d-request-dropped-reason
    │   ├── Saturated         429 rejected-saturated
    │   ├── TtlExpired        429 rejected-ttl-expired
    │   ├── NoEndpoints       503 rejected-no-endpoints
    │   └── ShuttingDown      503 rejected-shutting-down
    ├── UpstreamFailed        502 upstream connect/protocol failure
    └── UpstreamTimeout       504

Each class also names llm-d's error code (`canonical`: `BadRequest`, `NotFound`,
`ResourceExhausted`, `ServiceUnavailable`, …), the `error_code` label of
`llm_d_epp_request_error_total` and `inference_objective_request_error_total`.

Foreign exceptions (aiohttp, asyncio timeouts) are translated in `proxy.py` with
`raise … from exc`; `render` is the one place that writes the JSON body.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    canonical: str = "Internal"
    """llm-d's error code for this error (`pkg/common/error`), for the error metrics."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        self.extra_headers: Mapping[str, str] = {}
        """Headers this one response adds (e.g. `x-llm-d-flow-queue-duration-ms`)."""

    @property
    def headers(self) -> Mapping[str, str]:
        return {}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    canonical = "BadRequest"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    canonical = "Unauthorized"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    canonical = "Forbidden"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    param = "model"
    canonical = "NotFound"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    canonical = "NotFound"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    canonical = "BadRequest"


class Dropped(GatewayError):
    reason: str = "rejected"

    @property
    def headers(self) -> Mapping[str, str]:
        return {DROPPED_REASON_HEADER: self.reason}


class Saturated(Dropped):
    status = 429
    type = "rate_limit_error"
    code = "rejected-saturated"
    reason = "rejected-saturated"
    canonical = "ResourceExhausted"


class TtlExpired(Dropped):
    status = 429
    type = "rate_limit_error"
    code = "rejected-ttl-expired"
    reason = "rejected-ttl-expired"
    canonical = "ResourceExhausted"


class NoEndpoints(Dropped):
    status = 503
    type = "service_unavailable_error"
    code = "rejected-no-endpoints"
    reason = "rejected-no-endpoints"
    canonical = "ServiceUnavailable"


class ShuttingDown(Dropped):
    """The gateway is draining: queued and new requests are turned away."""

    status = 503
    type = "service_unavailable_error"
    code = "rejected-shutting-down"
    reason = "rejected-shutting-down"
    canonical = "ServiceUnavailable"


class UpstreamFailed(GatewayError):
    status = 502
    type = "bad_gateway_error"
    code = "upstream_failed"
    canonical = "ModelServerError"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout_error"
    code = "upstream_timeout"
    canonical = "ModelServerError"


def error_body(message: str, type_: str, code: str | int | None, param: str | None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


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


def sse_error_event(exc: GatewayError) -> bytes:
    """A mid-stream failure: an OpenAI-style error event, then the stream ends."""
    return b"data: " + error_body(exc.message, exc.type, exc.code, exc.param) + b"\n\n"
