import asyncio
import io

import orjson
import pytest

from servegate.gateway.access_log import AccessLog, AccessRecord


class CountingStream(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


class BrokenStream(io.BytesIO):
    def __init__(self, exc: Exception) -> None:
        super().__init__()
        self.exc = exc

    def write(self, data: object) -> int:
        raise self.exc

    def flush(self) -> None:
        raise self.exc


def record(rid: str) -> AccessRecord:
    return AccessRecord(request_id=rid, method="POST", path="/v1/chat/completions", status=200)


def lines(stream: io.BytesIO) -> list[str]:
    return [orjson.loads(line)["request_id"] for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize("count", [1, 3, 50], ids=["one", "three", "fifty"])
async def test_lines_of_one_loop_turn_share_one_flush_after_the_turn(count: int) -> None:
    stream = CountingStream()
    log = AccessLog(stream)
    for i in range(count):
        log.write(record(str(i)))
    assert stream.flushes == 0
    await asyncio.sleep(0)
    assert stream.flushes == 1
    assert lines(stream) == [str(i) for i in range(count)]
    log.write(record("next"))
    await asyncio.sleep(0)
    assert stream.flushes == 2


def test_without_a_running_loop_every_line_is_flushed_at_once() -> None:
    stream = CountingStream()
    log = AccessLog(stream)
    log.write(record("a"))
    log.write(record("b"))
    assert stream.flushes == 2
    assert lines(stream) == ["a", "b"]


async def test_a_disabled_log_writes_nothing() -> None:
    stream = CountingStream()
    AccessLog(stream, enabled=False).write(record("a"))
    await asyncio.sleep(0)
    assert (stream.getvalue(), stream.flushes) == (b"", 0)


@pytest.mark.parametrize(
    "exc", [OSError("disk full"), ValueError("closed file")], ids=["oserror", "closed"]
)
async def test_a_broken_stream_never_fails_the_request(exc: Exception) -> None:
    log = AccessLog(BrokenStream(exc))
    log.write(record("a"))
    await asyncio.sleep(0)
    log.flush()
