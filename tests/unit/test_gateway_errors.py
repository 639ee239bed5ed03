import orjson
import pytest

from servegate.gateway import errors


@pytest.mark.parametrize(
    ("exc", "status", "type_", "reason"),
    [
        pytest.param(errors.BadRequest("m"), 400, "invalid_request_error", None, id="400"),
        pytest.param(errors.Unauthorized("m"), 401, "authentication_error", None, id="401"),
        pytest.param(errors.ModelNotFound("m"), 404, "invalid_request_error", None, id="404"),
        pytest.param(errors.BodyTooLarge("m"), 413, "invalid_request_error", None, id="413"),
        pytest.param(
            errors.Saturated("m"), 429, "rate_limit_error", "rejected-saturated", id="429"
        ),
        pytest.param(
            errors.TtlExpired("m"), 429, "rate_limit_error", "rejected-ttl-expired", id="ttl"
        ),
        pytest.param(
            errors.NoEndpoints("m"),
            503,
            "service_unavailable_error",
            "rejected-no-endpoints",
            id="503",
        ),
        pytest.param(errors.UpstreamFailed("m"), 502, "bad_gateway_error", None, id="502"),
        pytest.param(errors.UpstreamTimeout("m"), 504, "timeout_error", None, id="504"),
    ],
)
def test_render_openai_error(
    exc: errors.GatewayError, status: int, type_: str, reason: str | None
) -> None:
    response = errors.render(exc, {"X-Request-ID": "r1"})
    assert response.status == status
    assert response.content_type == "application/json"
    assert response.headers["X-Request-ID"] == "r1"
    assert response.headers.get(errors.DROPPED_REASON_HEADER) == reason
    assert isinstance(response.body, bytes)
    body = orjson.loads(response.body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    assert body["error"]["message"] == "m"


def test_model_not_found_names_param() -> None:
    body = orjson.loads(errors.error_body("x", "t", "model_not_found", "model"))
    assert body["error"]["param"] == "model"


def test_sse_error_event_is_one_data_line() -> None:
    event = errors.sse_error_event(errors.UpstreamFailed("broke"))
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:])["error"]["code"] == "upstream_failed"
