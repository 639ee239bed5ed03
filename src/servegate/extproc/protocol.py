"""The endpoint-picker protocol on Envoy's ext_proc messages: names, readers, builders.

Everything that knows a protobuf field lives here, so the stream logic reads
plain Python values. The names are the Gateway API Inference Extension's
(proposal 004, "Endpoint Picker Protocol"):

    request  metadata  envoy.lb.subset_hint → x-gateway-destination-endpoint-subset: [ip:port…]
    answer   header    x-gateway-destination-endpoint: ip:port[,ip:port…]
             metadata  envoy.lb → x-gateway-destination-endpoint (the same value)
    response metadata  envoy.lb → x-gateway-destination-endpoint-served: ip:port

Two request body modes, told apart by the `protocol_config` Envoy puts on a stream's
first message (`Modes`). FULL_DUPLEX_STREAMED (and no `protocol_config`): the header
answer waits until the body is complete; bodies go back as `streamed_response` chunks of
at most `BODY_CHUNK_BYTES` (some Envoy builds cap a chunk at 64 KiB). BUFFERED: the
headers are answered at once with `CONTINUE` and the whole body comes in one message,
whose answer carries the destination (header mutation and metadata) and the body only
when the picker rewrote it. A response body mode of NONE means the response headers are
the last message Envoy sends.

The answers that never change are built once (`CONTINUE_REQUEST_HEADERS`, …). Handing
gRPC pre-serialised bytes through a Python serialiser measured slower than the generated
C serialiser on these cached messages (docs/benchmarks.md), so answers stay messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeadersResponse,
    ProcessingResponse,
    TrailersResponse,
)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
BODY_CHUNK_BYTES = 62_000
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BUFFERED
NO_BODY = ProcessingMode.NONE
OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

Message = Any
"""A protobuf message from xds-protos (the package ships no type stubs)."""


class ProtocolMismatch(Exception):
    """Envoy is configured for a processing mode this picker does not speak."""


# -- reading ---------------------------------------------------------------------------


def kind_of(request: Message) -> str:
    """Which oneof a `ProcessingRequest` carries: `request_headers`, `response_body`, …"""
    kind: str | None = request.WhichOneof("request")
    return kind or ""


def headers_of(header_map: Message) -> dict[str, str]:
    """A `HeaderMap` as lower-cased names → values (Envoy sends `raw_value` bytes)."""
    out: dict[str, str] = {}
    for header in header_map.headers:
        raw: bytes = header.raw_value
        value: str = raw.decode("utf-8", "replace") if raw else header.value
        out[header.key.lower()] = value
    return out


@dataclass(frozen=True, slots=True)
class Modes:
    """How Envoy's filter is set up for this stream, as its `protocol_config` says."""

    buffered_request: bool = False
    """The whole request body in one message, answered with the destination."""
    response_body: bool = True
    """Response body chunks follow the response headers (FULL_DUPLEX_STREAMED)."""


FULL_DUPLEX_MODES = Modes()
"""What a proxy that sends no `protocol_config` gets: the mode llm-d's router requires."""
_REQUEST_MODES = {FULL_DUPLEX: False, NO_BODY: False, BUFFERED: True}
_RESPONSE_MODES = {FULL_DUPLEX: True, NO_BODY: False}


def read_modes(request: Message) -> Modes:
    """The stream's modes; a mode this picker does not speak refuses the stream."""
    if not request.HasField("protocol_config"):
        return FULL_DUPLEX_MODES
    config = request.protocol_config
    buffered = _REQUEST_MODES.get(config.request_body_mode)
    response_body = _RESPONSE_MODES.get(config.response_body_mode)
    if buffered is None or response_body is None:
        names = ProcessingMode.BodySendMode.Name
        raise ProtocolMismatch(
            f"request_body_mode is {names(config.request_body_mode)} and response_body_mode "
            f"{names(config.response_body_mode)}; servegate's endpoint picker needs "
            "request_body_mode BUFFERED or FULL_DUPLEX_STREAMED and response_body_mode "
            "NONE or FULL_DUPLEX_STREAMED (see docs/extproc.md, 'Processing modes')"
        )
    return Modes(buffered, response_body)


def _metadata_value(request: Message, namespace: str, key: str) -> Message | None:
    if not request.HasField("metadata_context"):
        return None
    entries = request.metadata_context.filter_metadata
    if namespace not in entries:
        return None
    fields = entries[namespace].fields
    if key not in fields:
        return None
    return fields[key]


def subset_hint(request: Message) -> tuple[str, ...] | None:
    """The proxy's candidate subset, or None when it sets none (any endpoint may be picked).

    A list of strings is the protocol's shape; a comma-separated string is read
    too. Anything else counts as an empty subset, which the picker answers with 503.
    """
    value = _metadata_value(request, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    which = value.WhichOneof("kind")
    if which == "list_value":
        return tuple(
            v.string_value.strip()
            for v in value.list_value.values
            if v.WhichOneof("kind") == "string_value" and v.string_value.strip()
        )
    if which == "string_value":
        return tuple(p.strip() for p in value.string_value.split(",") if p.strip())
    return ()


def served_endpoint(request: Message) -> str | None:
    """The endpoint that served the request, as the proxy reports it on the response."""
    value = _metadata_value(request, DESTINATION_NAMESPACE, SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    served: str = value.string_value.split(",")[0].strip()
    return served or None


# -- building --------------------------------------------------------------------------
#
# Answers are built by assigning through one `ProcessingResponse` rather than by nesting
# constructors: upb copies every sub-message passed to a constructor, which made a
# response-headers answer cost ~25 µs against ~6 µs this way.


def add_headers(options: Message, headers: Mapping[str, str]) -> None:
    """Append `headers` to a repeated `HeaderValueOption`, each overwriting its namesake."""
    add = options.add
    for name, value in headers.items():
        add(header={"key": name, "raw_value": value.encode()}, append_action=OVERWRITE)


def set_destination(response: Message, destinations: str) -> None:
    """`envoy.lb` → `x-gateway-destination-endpoint` in the answer's dynamic metadata."""
    lb = response.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value
    lb.fields[DESTINATION_KEY].string_value = destinations


def destination_metadata(destinations: str) -> Message:
    response = ProcessingResponse()
    set_destination(response, destinations)
    return response.dynamic_metadata


def _route(
    response: Message,
    common: Message,
    set_headers: Mapping[str, str],
    remove_headers: Iterable[str],
    destinations: str,
) -> Message:
    common.clear_route_cache = True
    add_headers(common.header_mutation.set_headers, set_headers)
    common.header_mutation.remove_headers.extend(remove_headers)
    set_destination(response, destinations)
    return response


def request_headers_response(
    set_headers: Mapping[str, str], remove_headers: Iterable[str], destinations: str
) -> Message:
    """The answer to the request headers: where to send it, in a header and in metadata."""
    response = ProcessingResponse()
    common = response.request_headers.response
    return _route(response, common, set_headers, remove_headers, destinations)


def buffered_body_response(
    set_headers: Mapping[str, str],
    remove_headers: Iterable[str],
    destinations: str,
    body: bytes | None,
) -> Message:
    """BUFFERED mode's answer to the whole body: the destination as in
    `request_headers_response`, and the body only when it changed (`None`: unchanged)."""
    response = ProcessingResponse()
    common = response.request_body.response
    if body is not None:
        common.body_mutation.body = body
    return _route(response, common, set_headers, remove_headers, destinations)


def _body_chunk(direction: str, body: bytes, end_of_stream: bool) -> Message:
    response = ProcessingResponse()
    streamed = getattr(response, direction).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return response


def request_body_responses(body: bytes, end_of_stream: bool) -> list[Message]:
    """The body handed back in chunks; the last carries `end_of_stream` unless trailers follow."""
    if not body:
        return [_body_chunk("request_body", b"", end_of_stream)]
    out = []
    for start in range(0, len(body), BODY_CHUNK_BYTES):
        chunk = body[start : start + BODY_CHUNK_BYTES]
        last = start + BODY_CHUNK_BYTES >= len(body)
        out.append(_body_chunk("request_body", chunk, end_of_stream and last))
    return out


def response_headers_response(set_headers: Mapping[str, str]) -> Message:
    response = ProcessingResponse()
    add_headers(response.response_headers.response.header_mutation.set_headers, set_headers)
    return response


def response_body_response(body: bytes, end_of_stream: bool) -> Message:
    return _body_chunk("response_body", body, end_of_stream)


CONTINUE_REQUEST_HEADERS: Message = ProcessingResponse(request_headers=HeadersResponse())
"""BUFFERED mode's answer to the request headers: go on and send the body. Shared: never
mutate the answers built once."""
REQUEST_TRAILERS_ANSWER: Message = ProcessingResponse(request_trailers=TrailersResponse())
RESPONSE_TRAILERS_ANSWER: Message = ProcessingResponse(response_trailers=TrailersResponse())


def immediate_response(status: int, headers: Mapping[str, str], body: bytes) -> Message:
    """Answer the client directly (400/401/404/413/429/503): Envoy sends no request upstream."""
    response = ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = status
    add_headers(immediate.headers.set_headers, headers)
    immediate.body = body
    return response
