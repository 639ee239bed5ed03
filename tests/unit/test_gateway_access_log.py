import asyncio
import dataclasses
import io
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from servegate.gateway.access_log import (
    CLIPPED_FIELDS,
    FLUSH_BYTES,
    LOG_FIELD_CHARS,
    AccessLog,
    AccessRecord,
)


class CountingStream(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.writes = 0

    def write(self, data: object) -> int:
        self.writes += 1
        return super().write(data)  # type: ignore[call-overload]

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
    return AccessRecord(
        request_id=rid, method="POST", path="/v1/chat/completions", ts=1.5, status=200
    )


def lines(stream: io.BytesIO) -> list[str]:
    return [orjson.loads(line)["request_id"] for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize("count", [1, 3, 50], ids=["one", "three", "fifty"])
async def test_lines_of_many_loop_turns_share_one_write_after_the_interval(count: int) -> None:
    stream = CountingStream()
    log = AccessLog(stream, interval_s=0.02, max_bytes=1 << 20)
    for i in range(count):
        log.write(record(str(i)))
        await asyncio.sleep(0)
    assert (stream.writes, stream.flushes) == (0, 0)
    await asyncio.sleep(0.05)
    assert (stream.writes, stream.flushes) == (1, 1)
    assert lines(stream) == [str(i) for i in range(count)]
    log.write(record("next"))
    await asyncio.sleep(0.05)
    assert (stream.writes, stream.flushes) == (2, 2)
    assert lines(stream)[-1] == "next"


async def test_a_line_that_would_overfill_the_buffer_sends_the_buffer_first() -> None:
    stream = CountingStream()
    one = len(orjson.dumps(record("0"), option=orjson.OPT_APPEND_NEWLINE))
    log = AccessLog(stream, interval_s=60.0, max_bytes=3 * one)
    for i in range(7):
        log.write(record(str(i)))
    assert stream.writes == 2
    assert lines(stream) == [str(i) for i in range(6)]
    log.flush()
    assert lines(stream) == [str(i) for i in range(7)]


class WriteSizes(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data: object) -> int:
        self.sizes.append(len(data))  # type: ignore[arg-type]
        return super().write(data)  # type: ignore[call-overload]


async def test_no_write_splits_a_line_or_passes_the_pipes_atomic_size() -> None:
    stream = WriteSizes()
    log = AccessLog(stream, interval_s=60.0)
    for i in range(200):
        log.write(record(f"r{i}" * (i % 7)))
    log.write(record("x" * (FLUSH_BYTES + 10)))  # longer than a pipe write on its own
    log.write(record("after"))
    log.flush()
    assert lines(stream)[-2:] == ["x" * (FLUSH_BYTES + 10), "after"]
    assert len(lines(stream)) == 202
    assert max(stream.sizes[:-2]) <= FLUSH_BYTES
    assert stream.sizes[-2] > FLUSH_BYTES  # the long line went out alone
    written = 0
    for size in stream.sizes:  # each write ends a line
        written += size
        assert stream.getvalue()[written - 1 : written] == b"\n"


async def test_flush_writes_what_is_buffered_and_disarms_the_timer() -> None:
    stream = CountingStream()
    log = AccessLog(stream, interval_s=0.01)
    log.write(record("a"))
    log.flush()
    assert (stream.writes, lines(stream)) == (1, ["a"])
    await asyncio.sleep(0.03)
    assert (stream.writes, stream.flushes) == (1, 1)


def test_a_timer_left_on_a_closed_loop_does_not_strand_the_next_loops_lines() -> None:
    stream = CountingStream()
    log = AccessLog(stream, interval_s=0.01)

    async def write_and_leave(rid: str) -> None:
        log.write(record(rid))

    async def write_and_wait(rid: str) -> None:
        log.write(record(rid))
        await asyncio.sleep(0.03)

    asyncio.run(write_and_leave("first"))  # its loop closes before the timer fires
    asyncio.run(write_and_wait("second"))
    assert lines(stream) == ["first", "second"]


def test_a_clean_exit_writes_the_buffered_lines(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(
        "import asyncio, sys\n"
        "from servegate.gateway.access_log import AccessLog, AccessRecord\n"
        "log = AccessLog(open(sys.argv[1], 'wb'), interval_s=60.0)\n"
        "async def main():\n"
        "    for i in range(3):\n"
        "        log.write(AccessRecord(str(i), 'POST', '/v1/completions', status=200))\n"
        "asyncio.run(main())\n"
    )
    out = tmp_path / "access.log"
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=60)
    assert [orjson.loads(line)["request_id"] for line in out.read_bytes().splitlines()] == [
        "0",
        "1",
        "2",
    ]


@pytest.mark.parametrize("name", CLIPPED_FIELDS)
def test_a_long_client_string_is_clipped_even_in_the_shortest_line(name: str) -> None:
    stream = io.BytesIO()
    log = AccessLog(stream)
    short = AccessRecord(request_id="", method="", path="", ts=0.0, logger="")
    setattr(short, name, "x" * LOG_FIELD_CHARS)
    log.write(short)
    long = AccessRecord(request_id="", method="", path="", ts=0.0, logger="")
    setattr(long, name, "y" * (LOG_FIELD_CHARS + 1))
    log.write(long)
    first, second = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert first[name] == "x" * LOG_FIELD_CHARS
    assert second[name] == "y" * LOG_FIELD_CHARS + f"… ({LOG_FIELD_CHARS + 1} characters)"


def test_a_long_line_keeps_its_short_fields_and_other_long_ones() -> None:
    stream = io.BytesIO()
    log = AccessLog(stream)
    long = AccessRecord(request_id="r" * 600, method="POST", path="/v1/completions")
    long.model = "m"
    log.write(long)
    line = orjson.loads(stream.getvalue())
    assert (line["request_id"], line["model"], line["path"]) == ("r" * 600, "m", "/v1/completions")


def test_the_line_has_every_public_field_in_order() -> None:
    stream = io.BytesIO()
    AccessLog(stream).write(record("a"))
    line = orjson.loads(stream.getvalue())
    public = [f.name for f in dataclasses.fields(AccessRecord) if not f.name.startswith("_")]
    assert list(line) == public


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


def test_a_record_at_arrival_is_the_constructed_record() -> None:
    before = time.time()
    fast = AccessRecord.arrived("r", "POST", "/v1/completions")
    built = AccessRecord("r", "POST", "/v1/completions", ts=fast.ts)
    assert before <= fast.ts <= time.time()
    assert fast == built
    assert list(vars(fast)) == list(vars(built))
    assert orjson.dumps(fast) == orjson.dumps(built)
    fast.relayed(1.0)
    fast.relayed(1.5)
    assert fast.itl is not None and fast.itl.count == 1
    assert built.itl is None
    public = [f.name for f in dataclasses.fields(AccessRecord) if not f.name.startswith("_")]
    assert list(orjson.loads(orjson.dumps(fast))) == public  # the gap state is not logged
