"""A stand-in for Envoy's side of ext_proc: the messages it sends, in the order it sends them.

For tests and the benchmark, where no Envoy runs: `ProxyStream` drives one
`Process` stream through a request the way Envoy's ext_proc filter does in
FULL_DUPLEX_STREAMED mode (request headers, then every body chunk without
waiting, the last with `end_of_stream`, or request trailers; then the response
headers with the served endpoint in `envoy.lb` metadata, body chunks and trailers)
or, with `BUFFERED_NO_RESPONSE_BODY`, in deploy/extproc/envoy-buffered.yaml's modes (request
headers, wait for their answer, the whole body in one message; the response headers
are the last message), and collects the picker's answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProtocolConfiguration,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from servegate.extproc.protocol import (
    BUFFERED,
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    FULL_DUPLEX,
    FULL_DUPLEX_MODES,
    NO_BODY,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    Message,
    Modes,
)

BUFFERED_NO_RESPONSE_BODY = Modes(buffered_request=True, response_body=False)
"""deploy/extproc/envoy-buffered.yaml: request body BUFFERED, response body NONE."""

# -- messages ------------------------------------------------------------------------


def header_map(headers: Sequence[tuple[str, str]]) -> Message:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])


def metadata(entries: Mapping[str, Mapping[str, Any]]) -> Message:
    out = Metadata()
    for namespace, values in entries.items():
        out.filter_metadata[namespace].update(dict(values))
    return out


def request_headers(
    headers: Sequence[tuple[str, str]],
    end_of_stream: bool = False,
    subset: Sequence[str] | None = None,
    body_mode: int = FULL_DUPLEX,
    response_body_mode: int = FULL_DUPLEX,
) -> Message:
    message = ProcessingRequest(
        request_headers=HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream),
        protocol_config=ProtocolConfiguration(
            request_body_mode=body_mode, response_body_mode=response_body_mode
        ),
    )
    if subset is not None:
        message.metadata_context.CopyFrom(metadata({SUBSET_NAMESPACE: {SUBSET_KEY: list(subset)}}))
    return message


def request_body(body: bytes, end_of_stream: bool) -> Message:
    return ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=end_of_stream))


def request_trailers(trailers: Sequence[tuple[str, str]]) -> Message:
    return ProcessingRequest(request_trailers=HttpTrailers(trailers=header_map(trailers)))


def response_headers(
    headers: Sequence[tuple[str, str]], served: str | None = None, end_of_stream: bool = False
) -> Message:
    message = ProcessingRequest(
        response_headers=HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if served is not None:
        message.metadata_context.CopyFrom(metadata({DESTINATION_NAMESPACE: {SERVED_KEY: served}}))
    return message


def response_body(body: bytes, end_of_stream: bool) -> Message:
    return ProcessingRequest(response_body=HttpBody(body=body, end_of_stream=end_of_stream))


def response_trailers(trailers: Sequence[tuple[str, str]]) -> Message:
    return ProcessingRequest(response_trailers=HttpTrailers(trailers=header_map(trailers)))


def chunks(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)] or [b""]


# -- what came back ------------------------------------------------------------------


@dataclass(slots=True)
class RequestAnswer:
    """The picker's answer to the request path, decoded."""

    immediate_status: int | None = None
    immediate_headers: dict[str, str] = field(default_factory=dict)
    immediate_body: bytes = b""
    set_headers: dict[str, str] = field(default_factory=dict)
    removed_headers: list[str] = field(default_factory=list)
    metadata_destination: str | None = None
    clear_route_cache: bool = False
    body: bytes = b""
    body_chunks: int = 0
    body_end_of_stream: bool = False
    trailers_answered: bool = False
    kinds: list[str] = field(default_factory=list)
    """The oneof of every response, in order (`request_headers`, `request_body`, …)."""

    @property
    def destination(self) -> str | None:
        return self.set_headers.get(DESTINATION_KEY)

    @property
    def endpoints(self) -> list[str]:
        return (self.destination or "").split(",") if self.destination else []


def _decode_routing(answer: RequestAnswer, response: Message, common: Message) -> None:
    answer.clear_route_cache = common.clear_route_cache
    answer.set_headers = {
        o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers
    }
    answer.removed_headers = list(common.header_mutation.remove_headers)
    fields = response.dynamic_metadata.fields
    if DESTINATION_NAMESPACE in fields:
        lb = fields[DESTINATION_NAMESPACE].struct_value.fields
        if DESTINATION_KEY in lb:
            answer.metadata_destination = lb[DESTINATION_KEY].string_value


def decode_request_answer(
    responses: Sequence[Message], sent_body: bytes | None = None
) -> RequestAnswer:
    """The answers decoded. `sent_body`: the body a BUFFERED-mode proxy sent, which it keeps
    when the answer does not replace it."""
    answer = RequestAnswer()
    for response in responses:
        kind = response.WhichOneof("response")
        answer.kinds.append(kind)
        if kind == "immediate_response":
            immediate = response.immediate_response
            answer.immediate_status = immediate.status.code
            answer.immediate_headers = {
                o.header.key: o.header.raw_value.decode() for o in immediate.headers.set_headers
            }
            answer.immediate_body = immediate.body
        elif kind == "request_headers":
            _decode_routing(answer, response, response.request_headers.response)
        elif kind == "request_body" and sent_body is not None:  # BUFFERED: one answer
            common = response.request_body.response
            _decode_routing(answer, response, common)
            mutation = common.body_mutation
            replaced = mutation.WhichOneof("mutation") == "body"
            answer.body = mutation.body if replaced else sent_body
            answer.body_chunks = 1
            answer.body_end_of_stream = True
        elif kind == "request_body":
            streamed = response.request_body.response.body_mutation.streamed_response
            answer.body += streamed.body
            answer.body_chunks += 1
            answer.body_end_of_stream = streamed.end_of_stream
        elif kind == "request_trailers":
            answer.trailers_answered = True
    return answer


def response_header_mutation(response: Message) -> dict[str, str]:
    mutation = response.response_headers.response.header_mutation
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


# -- a stream ------------------------------------------------------------------------


class ProxyStream:
    """One `Process` call: `await request(...)`, then `await respond(...)`, then `await close()`."""

    def __init__(self, channel: grpc.aio.Channel, modes: Modes = FULL_DUPLEX_MODES) -> None:
        self.call: Any = ExternalProcessorStub(channel).Process()
        self.modes = modes
        self.sent = 0

    async def send(self, message: Message) -> None:
        await self.call.write(message)
        self.sent += 1

    async def read(self) -> Message:
        message = await self.call.read()
        if message is grpc.aio.EOF:  # type: ignore[attr-defined]
            raise EOFError("the picker ended the stream")
        return message

    async def request(
        self,
        path: str,
        body: bytes | None,
        headers: Sequence[tuple[str, str]] = (),
        subset: Sequence[str] | None = None,
        chunk_size: int = 16 * 1024,
        trailers: Sequence[tuple[str, str]] | None = None,
        method: str = "POST",
    ) -> RequestAnswer:
        """Send the request the way Envoy does and read the picker's answers to it."""
        pseudo = [(":method", method), (":path", path), (":authority", "gateway"),
                  (":scheme", "http")]  # fmt: skip
        if body is not None:
            pseudo.append(("content-type", "application/json"))
            pseudo.append(("content-length", str(len(body))))
        all_headers = [*pseudo, *headers]
        no_body = body is None and trailers is None
        modes = self.modes
        await self.send(
            request_headers(
                all_headers,
                end_of_stream=no_body,
                subset=subset,
                body_mode=BUFFERED if modes.buffered_request else FULL_DUPLEX,
                response_body_mode=FULL_DUPLEX if modes.response_body else NO_BODY,
            )
        )
        if modes.buffered_request and not no_body:
            return await self._buffered_request(body or b"", trailers)
        if body is not None:
            parts = chunks(body, chunk_size)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1 and trailers is None
                await self.send(request_body(part, last))
        if trailers is not None:
            await self.send(request_trailers(trailers))
        responses = []
        while True:
            response = await self.read()
            responses.append(response)
            kind = response.WhichOneof("response")
            if kind == "immediate_response":
                break
            if no_body and kind == "request_headers":
                break
            if trailers is not None and kind == "request_trailers":
                break
            if trailers is None and kind == "request_body":
                streamed = response.request_body.response.body_mutation.streamed_response
                if streamed.end_of_stream:
                    break
        return decode_request_answer(responses)

    async def _buffered_request(
        self, body: bytes, trailers: Sequence[tuple[str, str]] | None
    ) -> RequestAnswer:
        """BUFFERED: the headers' answer comes first, then the whole body goes in one message."""
        responses = [await self.read()]
        if responses[0].WhichOneof("response") == "immediate_response":
            return decode_request_answer(responses)
        await self.send(request_body(body, trailers is None))
        responses.append(await self.read())
        if trailers is not None and responses[-1].WhichOneof("response") != "immediate_response":
            await self.send(request_trailers(trailers))
            responses.append(await self.read())
        answer = decode_request_answer(responses[1:], sent_body=body)
        answer.kinds[:0] = [responses[0].WhichOneof("response")]
        return answer

    async def respond(
        self,
        status: int,
        body_chunks: Sequence[bytes],
        served: str | None = None,
        content_type: str = "application/json",
        trailers: Sequence[tuple[str, str]] | None = None,
    ) -> tuple[dict[str, str], bytes]:
        """Send the upstream's response through; the header mutation and the body handed back."""
        headers = [(":status", str(status)), ("content-type", content_type)]
        empty = not body_chunks and trailers is None
        await self.send(response_headers(headers, served=served, end_of_stream=empty))
        mutation = response_header_mutation(await self.read())
        if not self.modes.response_body:  # the proxy relays the body without the picker
            return mutation, b"".join(body_chunks)
        returned = b""
        for i, part in enumerate(body_chunks):
            last = i == len(body_chunks) - 1 and trailers is None
            await self.send(response_body(part, last))
            echoed = await self.read()
            streamed = echoed.response_body.response.body_mutation.streamed_response
            returned += streamed.body
        if trailers is not None:
            await self.send(response_trailers(trailers))
            await self.read()
        return mutation, returned

    async def close(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()
