"""Reading and writing the endpoint-picker protocol's ext_proc messages."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from servegate.extproc import client as proxy
from servegate.extproc.protocol import (
    BODY_CHUNK_BYTES,
    FULL_DUPLEX_MODES,
    Modes,
    ProtocolMismatch,
    destination_metadata,
    headers_of,
    immediate_response,
    read_modes,
    request_body_responses,
    request_headers_response,
    served_endpoint,
    subset_hint,
)


def test_headers_are_lower_cased_and_read_from_raw_value_or_value() -> None:
    header_map = HeaderMap(
        headers=[
            HeaderValue(key=":path", raw_value=b"/v1/completions"),
            HeaderValue(key="X-Session-Id", value="abc"),
        ]
    )
    assert headers_of(header_map) == {":path": "/v1/completions", "x-session-id": "abc"}


def _with_subset(value: Any) -> Any:
    request = ProcessingRequest()
    request.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": value}
    )
    return request


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        pytest.param(ProcessingRequest(), None, id="no-metadata"),
        pytest.param(
            _with_subset(["1.1.1.1:80", "2.2.2.2:80"]), ("1.1.1.1:80", "2.2.2.2:80"), id="list"
        ),
        pytest.param(_with_subset([]), (), id="empty-list"),
        pytest.param(
            _with_subset("1.1.1.1:80, 2.2.2.2:80"), ("1.1.1.1:80", "2.2.2.2:80"), id="comma-string"
        ),
        pytest.param(_with_subset(7), (), id="malformed-is-empty"),
    ],
)
def test_subset_hint(request_: Any, expected: tuple[str, ...] | None) -> None:
    assert subset_hint(request_) == expected


@pytest.mark.parametrize(
    ("served", "expected"),
    [
        pytest.param(None, None, id="absent"),
        pytest.param("10.0.0.1:8000", "10.0.0.1:8000", id="one"),
        pytest.param("10.0.0.1:8000,10.0.0.2:8000", "10.0.0.1:8000", id="list-first"),
    ],
)
def test_served_endpoint(served: str | None, expected: str | None) -> None:
    assert served_endpoint(proxy.response_headers([(":status", "200")], served=served)) == expected


# BodySendMode: NONE 0, STREAMED 1, BUFFERED 2, BUFFERED_PARTIAL 3, FULL_DUPLEX_STREAMED 4
@pytest.mark.parametrize(
    ("request_mode", "response_mode", "expected"),
    [
        pytest.param(4, 4, Modes(buffered_request=False, response_body=True), id="full-duplex"),
        pytest.param(0, 4, Modes(buffered_request=False, response_body=True), id="no-body"),
        pytest.param(2, 0, Modes(buffered_request=True, response_body=False), id="buffered-none"),
        pytest.param(2, 4, Modes(buffered_request=True, response_body=True), id="buffered-duplex"),
        pytest.param(4, 0, Modes(buffered_request=False, response_body=False), id="duplex-none"),
        pytest.param(1, 4, None, id="streamed-request"),
        pytest.param(3, 0, None, id="buffered-partial-request"),
        pytest.param(2, 2, None, id="buffered-response"),
        pytest.param(4, 1, None, id="streamed-response"),
    ],
)
def test_read_modes(request_mode: int, response_mode: int, expected: Modes | None) -> None:
    message = proxy.request_headers(
        [(":path", "/")], body_mode=request_mode, response_body_mode=response_mode
    )
    if expected is None:
        with pytest.raises(ProtocolMismatch, match="BUFFERED or FULL_DUPLEX_STREAMED"):
            read_modes(message)
    else:
        assert read_modes(message) == expected


def test_a_proxy_that_announces_no_modes_is_taken_for_full_duplex() -> None:
    assert read_modes(ProcessingRequest()) == FULL_DUPLEX_MODES == Modes(False, True)


@pytest.mark.parametrize(
    ("size", "end_of_stream", "expected"),
    [
        pytest.param(0, True, [(0, True)], id="empty"),
        pytest.param(10, True, [(10, True)], id="small"),
        # 62000 + 62000 + 1 bytes → three pieces, only the last marked
        pytest.param(
            2 * BODY_CHUNK_BYTES + 1,
            True,
            [(BODY_CHUNK_BYTES, False), (BODY_CHUNK_BYTES, False), (1, True)],
            id="three-pieces",
        ),
        pytest.param(BODY_CHUNK_BYTES, False, [(BODY_CHUNK_BYTES, False)], id="trailers-follow"),
    ],
)
def test_request_body_chunks(
    size: int, end_of_stream: bool, expected: list[tuple[int, bool]]
) -> None:
    out = request_body_responses(b"x" * size, end_of_stream)
    streamed = [r.request_body.response.body_mutation.streamed_response for r in out]
    assert [(len(s.body), s.end_of_stream) for s in streamed] == expected


def test_headers_response_overwrites_the_destination_and_sets_the_same_metadata() -> None:
    response = request_headers_response(
        {"x-gateway-destination-endpoint": "a:1,b:2"}, ["x-prefiller-host-port"], "a:1,b:2"
    )
    common = response.request_headers.response
    option = common.header_mutation.set_headers[0]
    assert option.append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert (option.header.key, option.header.raw_value) == (
        "x-gateway-destination-endpoint",
        b"a:1,b:2",
    )
    assert list(common.header_mutation.remove_headers) == ["x-prefiller-host-port"]
    assert common.clear_route_cache
    assert response.dynamic_metadata == destination_metadata("a:1,b:2")
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "a:1,b:2"


def test_immediate_response_carries_status_headers_and_body() -> None:
    response = immediate_response(429, {"x-llm-d-request-dropped-reason": "r"}, b"{}")
    immediate = response.immediate_response
    assert immediate.status.code == 429
    assert immediate.headers.set_headers[0].header.raw_value == b"r"
    assert immediate.body == b"{}"
