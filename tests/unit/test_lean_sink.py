"""`LeanSink` holds a started answer's head for the bytes that follow in the same turn."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from servegate.gateway.lean_server import LeanSink, SinkConnection


class Transport:
    def __init__(self) -> None:
        self.sends: list[bytes] = []
        self.closing = False

    def writelines(self, parts: Any) -> None:
        self.sends.append(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True


class Conn:
    """The part of `LeanProtocol` a sink uses."""

    def __init__(self) -> None:
        self.transport = Transport()
        self.peer = "127.0.0.1"
        self.paused_writing = False
        self.loop = asyncio.get_running_loop()
        self.drained = 0

    def connection_line(self) -> bytes:
        return b""

    def send(self, *parts: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the client left")
        self.transport.writelines(parts)

    async def drain(self) -> None:
        self.drained += 1

    def abort(self) -> None:
        self.transport.abort()


def sink_on(conn: Conn) -> LeanSink:
    return LeanSink(cast(SinkConnection, conn))


async def test_a_stream_whose_first_event_follows_at_once_is_one_write() -> None:
    conn = Conn()
    sink = sink_on(conn)
    await sink.start(200, [("Content-Type", "text/event-stream")], None)
    assert conn.transport.sends == []
    await sink.write(b"data: 1\n\n")
    await asyncio.sleep(0)
    assert len(conn.transport.sends) == 1
    sent = conn.transport.sends[0]
    assert sent.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding: chunked\r\n" in sent
    assert sent.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    await sink.end(b"")
    assert conn.transport.sends[1:] == [b"0\r\n\r\n"]


async def test_a_head_with_nothing_after_it_goes_alone_on_the_next_turn() -> None:
    conn = Conn()
    sink = sink_on(conn)
    await sink.start(200, [("Content-Type", "text/event-stream")], None)
    await asyncio.sleep(0)
    assert len(conn.transport.sends) == 1
    assert conn.transport.sends[0].endswith(b"Transfer-Encoding: chunked\r\n\r\n")
    await sink.write(b"data: 1\n\n")
    assert conn.transport.sends[1] == b"9\r\ndata: 1\n\n\r\n"


async def test_end_carries_a_held_head_and_a_known_length_body() -> None:
    conn = Conn()
    sink = sink_on(conn)
    await sink.start(200, [], 5)
    await sink.end(b"hello")
    await asyncio.sleep(0)
    assert len(conn.transport.sends) == 1
    assert conn.transport.sends[0].endswith(b"Content-Length: 5\r\n\r\nhello")


async def test_an_aborted_answer_never_sends_its_held_head() -> None:
    conn = Conn()
    sink = sink_on(conn)
    await sink.start(200, [], None)
    sink.abort()
    await asyncio.sleep(0)
    assert conn.transport.sends == []


async def test_a_paused_client_is_waited_for_and_a_reading_one_is_not() -> None:
    conn = Conn()
    sink = sink_on(conn)
    await sink.start(200, [("Content-Type", "text/event-stream")], None)
    await sink.write(b"data: 1\n\n")
    assert conn.drained == 0  # not paused: no drain to wait for
    conn.paused_writing = True
    await sink.write(b"data: 2\n\n")
    await sink.end(b"")
    assert conn.drained == 2  # every write while the client's buffer is full waits


async def test_a_whole_answer_to_a_paused_client_waits_for_it() -> None:
    conn = Conn()
    conn.paused_writing = True
    await sink_on(conn).respond(200, [("Content-Type", "application/json")], b"{}")
    assert conn.drained == 1
