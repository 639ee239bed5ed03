"""`Deadlines`: far deadlines swept, near ones timed; and the lean transport's exchanges
expiring through the sweep (first-byte, then total) as they do through their own timers."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.unit.test_lean_transport import answering, lean, post, raw_server

from servegate.gateway.deadlines import Deadlines


async def test_a_near_deadline_gets_its_own_timer_and_a_far_one_is_swept() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, grain_s=0.05, far_s=1.0)
    fired: list[str] = []
    timer = deadlines.arm("near", loop.time() + 0.05, lambda: fired.append("near"))
    assert isinstance(timer, asyncio.TimerHandle)
    assert deadlines.arm("far", loop.time() + 1.2, lambda: fired.append("far")) is None
    assert len(deadlines) == 1
    await asyncio.sleep(0.2)
    assert fired == ["near"]
    await asyncio.sleep(1.2)
    assert fired == ["near", "far"]
    assert len(deadlines) == 0
    deadlines.close()


async def test_a_swept_deadline_fires_at_most_a_grain_late_and_never_early() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, grain_s=0.1, far_s=0.0)
    when = loop.time() + 0.25
    fired: list[float] = []
    deadlines.arm("x", when, lambda: fired.append(loop.time()))
    await asyncio.sleep(0.5)
    assert len(fired) == 1
    assert when <= fired[0] <= when + 0.1 + 0.05  # one grain, plus the loop's own slack
    deadlines.close()


async def test_a_disarmed_deadline_never_fires_and_the_sweep_stops() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, grain_s=0.05, far_s=0.0)
    fired: list[str] = []
    deadlines.arm("x", loop.time() + 0.1, lambda: fired.append("x"))
    deadlines.disarm("x")
    await asyncio.sleep(0.25)
    assert fired == []
    assert deadlines._sweeper is None  # nothing left to sweep: no callback a grain
    deadlines.close()


def swept(transport: object) -> Deadlines:
    """Every deadline of `transport` swept every 50 ms (as a 300 s one is at the defaults)."""
    deadlines = Deadlines(asyncio.get_running_loop(), grain_s=0.05, far_s=0.0)
    transport._deadlines = deadlines  # type: ignore[attr-defined]
    return deadlines


async def test_a_swept_total_deadline_fails_the_exchange() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async with raw_server(silent) as base, lean() as transport:
        deadlines = swept(transport)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="total"):
            await post(transport, base + "/", total_s=0.2)
        assert 0.2 <= time.monotonic() - started < 1.0
        assert len(deadlines) == 0


async def test_a_swept_first_byte_deadline_then_arms_the_total_one() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some"
    async with raw_server(answering(answer, close=False)) as base, lean() as transport:
        swept(transport)
        response = await post(transport, base + "/", head_s=0.1, total_s=0.4)
        assert await response.content.readany() == b"only some"
        with pytest.raises(TimeoutError, match="total"):
            await response.content.readany()
        response.close()


async def test_an_exchange_that_ends_leaves_nothing_to_sweep() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_server(answering(answer)) as base, lean() as transport:
        deadlines = swept(transport)
        response = await post(transport, base + "/", head_s=5.0, total_s=30.0)
        assert len(deadlines) == 0  # the answer ended in the read that brought its head
        assert await response.content.readany() == b"ok"
        response.release()


async def test_an_exchange_closed_mid_body_leaves_nothing_to_sweep() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok"
    async with raw_server(answering(answer, close=False)) as base, lean() as transport:
        deadlines = swept(transport)
        response = await post(transport, base + "/", head_s=5.0, total_s=30.0)
        assert len(deadlines) == 1  # the first-byte one: when it passes it arms the total one
        assert await response.content.readany() == b"ok"
        response.close()
        assert len(deadlines) == 0
