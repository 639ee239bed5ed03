"""Every error a client can see, rendered in OpenAI's format.

    GatewayError (status, OpenAI type, code, extra headers)
    ├── BadRequest            400 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error
    ├── ModelNotFound         404 invalid_request_error / model_not_found
    ├── NotFound              404 (unknown route)
    ├── RequestTimeout        408 invalid_request_error (the body came too slowly)
    ├── BodyTooLarge          413 invalid_request_error
    ├── Dropped               429/503 with x-llm-d-request-dropped-reason
    │   ├── Saturated         429 rejected-saturated
    │   ├── TtlExpired        429 rejected-ttl-expired
    │   ├── NoEndpoints       503 rejected-no-endpoints
    │   └── ShuttingDown      503 rejected-shutting-down
    ├── UpstreamFailed        502 upstream connect/protocol failure
    ├── UpstreamTimeout       504
    └── InternalError         500 server_error (an exception nothing else expected)

`for_status` builds one for any status (aiohttp's own HTTP exceptions, a replica's error
that is not JSON), with the standard `type` for it (`TYPE_BY_STATUS`).

Each class also names llm-d's error code (`canonical`: `BadRequest`, `NotFound`,
`ResourceExhausted`, `ServiceUnavailable`, …), the `error_code` label of
`llm_d_epp_request_error_total` and `inference_objective_request_error_total`.

Every data plane maps these: the planes that carry bodies write one through their
`ClientSink` (`control/sink.py`'s `send_error`; `gateway/errors.py`'s `render` for
aiohttp's own routes), the ext_proc picker as an `ImmediateResponse`; so this module
imports no HTTP framework. Foreign exceptions (aiohttp, asyncio timeouts) are
translated in `gateway/proxy.py` with `raise … from exc`.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

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


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


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


class SloUnattainable(Dropped):
    """The latency-slo-admitter's: a sheddable request no endpoint is predicted to serve
    within its SLO. (Here, not in gateway/latency.py: mypyc compiles that module, and a
    compiled subclass loses the class attributes it overrides.)"""

    status = 429
    type = "rate_limit_error"
    code = "rejected-slo"
    reason = "rejected-slo"


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


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    code = "internal_error"


TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def for_status(status: int, message: str, code: str | None = None) -> GatewayError:
    """An error with `status` and the standard OpenAI `type` for it."""
    error = GatewayError(message)
    error.status = status
    error.type = TYPE_BY_STATUS.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    error.code = code
    return error


DESCRIBE_CHARS = 200
ECHO_CHARS = 256
"""The most of a client-supplied string (a model name, a path) an error or log line repeats."""


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def describe(exc: BaseException) -> str:
    """A foreign exception for an error message or a log line: its type and message, never
    its repr (aiohttp's `ClientResponseError` repr carries the request's headers, and with
    them the client's `Authorization` and `Cookie`), cut to `DESCRIBE_CHARS`."""
    message = getattr(exc, "message", None)
    text = message if isinstance(message, str) else str(exc)
    text = " ".join(text.split())
    if len(text) > DESCRIBE_CHARS:
        text = text[:DESCRIBE_CHARS] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_body(message: str, type_: str, code: str | int | None, param: str | None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def error_headers(
    exc: GatewayError, extra_headers: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """The headers of `exc`'s answer, in the order they are sent: its own, the request's
    (`extra_headers`), then the JSON content type."""
    headers = dict(exc.headers)
    headers.update(exc.extra_headers)
    if extra_headers:
        headers.update(extra_headers)
    out = [(k, v) for k, v in headers.items() if k.lower() != "content-type"]
    out.append(("Content-Type", "application/json"))
    return out


def error_answer(exc: GatewayError) -> bytes:
    """`exc` as the body of an answer."""
    return error_body(exc.message, exc.type, exc.code, exc.param)


def sse_error_event(exc: GatewayError) -> bytes:
    """A mid-stream failure: an OpenAI-style error event, then the stream ends."""
    return b"data: " + error_body(exc.message, exc.type, exc.code, exc.param) + b"\n\n"
