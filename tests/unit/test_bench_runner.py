from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from servegate.bench.runner import (
    BenchPlan,
    LoadKind,
    LoadPoint,
    SendOptions,
    Target,
    arrival_offsets,
    run_plan,
    run_segment,
    split_rounds,
)
from servegate.bench.workloads import Api, BenchRequest, MultiTurnWorkload

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


@dataclass
class Seen:
    server: str
    text: str
    session: str | None
    started: float
    ended: float = 0.0


@dataclass
class Recorder:
    """Model servers that log every request, count them on /metrics, and can be slow."""

    delay_s: float = 0.0
    log: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    resets: list[str] = field(default_factory=list)

    def app(self, name: str, with_reset: bool = True) -> web.Application:
        served = 0

        async def answer(request: web.Request) -> web.StreamResponse:
            nonlocal served
            body = orjson.loads(await request.read())
            text = body.get("prompt") or body["messages"][0]["content"]
            seen = Seen(name, text, request.headers.get("x-session-id"), time.perf_counter())
            self.log.append(seen)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1
            served += 1
            seen.ended = time.perf_counter()
            return web.json_response({"usage": {"prompt_tokens": 4, "completion_tokens": 2}})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=f'vllm:request_success_total{{m="x"}} {served}.0\n')

        async def reset(request: web.Request) -> web.Response:
            self.resets.append(name)
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_post("/v1/chat/completions", answer)
        app.router.add_get("/metrics", metrics)
        if with_reset:
            app.router.add_post("/reset_prefix_cache", reset)
        return app


async def start(aiohttp_server: ServerFactory, app: web.Application) -> str:
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def prompts(count: int) -> list[BenchRequest]:
    return [BenchRequest("m", 2, prompt=f"p{i}") for i in range(count)]


NOT_STREAMED = SendOptions(stream=False, timeout_s=10)


async def test_concurrency_bounds_requests_in_flight(
    aiohttp_server: ServerFactory, session: aiohttp.ClientSession
) -> None:
    recorder = Recorder(delay_s=0.05)
    url = await start(aiohttp_server, recorder.app("a"))
    segment = await run_segment(
        session,
        url,
        prompts(12),
        LoadPoint(LoadKind.CONCURRENCY, 3),
        options=NOT_STREAMED,
        duration_s=30,
    )
    assert len(segment.results) == 12
    assert all(r.ok for r in segment.results)
    assert recorder.max_in_flight == 3
    assert sorted(s.text for s in recorder.log) == sorted(f"p{i}" for i in range(12))


async def test_deadline_stops_new_requests(
    aiohttp_server: ServerFactory, session: aiohttp.ClientSession
) -> None:
    recorder = Recorder(delay_s=0.1)
    url = await start(aiohttp_server, recorder.app("a"))
    segment = await run_segment(
        session,
        url,
        prompts(50),
        LoadPoint(LoadKind.CONCURRENCY, 1),
        options=NOT_STREAMED,
        duration_s=0.3,
    )
    # 50 requests of 0.1 s would need 5 s; the 0.3 s limit stops it early
    assert 1 <= len(segment.results) < 50


async def test_session_turns_wait_for_the_previous_turn(
    aiohttp_server: ServerFactory, session: aiohttp.ClientSession
) -> None:
    recorder = Recorder(delay_s=0.03)
    url = await start(aiohttp_server, recorder.app("a"))
    requests = MultiTurnWorkload(sessions=3, turns=3, system_prompt_len=4).generate(
        model="m", api=Api.CHAT, seed=0
    )
    segment = await run_segment(
        session,
        url,
        requests,
        LoadPoint(LoadKind.CONCURRENCY, 9),
        options=NOT_STREAMED,
        duration_s=30,
    )
    assert len(segment.results) == 9
    by_session: dict[str | None, list[Seen]] = {}
    for seen in recorder.log:
        by_session.setdefault(seen.session, []).append(seen)
    assert len(by_session) == 3
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            assert later.started >= earlier.ended


async def test_rate_mode_sends_every_request_before_the_deadline(
    aiohttp_server: ServerFactory, session: aiohttp.ClientSession
) -> None:
    recorder = Recorder()
    url = await start(aiohttp_server, recorder.app("a"))
    segment = await run_segment(
        session,
        url,
        prompts(20),
        LoadPoint(LoadKind.RATE, 200),
        options=NOT_STREAMED,
        duration_s=30,
        seed=1,
    )
    assert len(segment.results) == 20
    assert len(recorder.log) == 20


def test_poisson_offsets_are_seeded() -> None:
    requests = prompts(1000)
    first = arrival_offsets(requests, LoadPoint(LoadKind.RATE, 5), seed=3)
    assert first == arrival_offsets(requests, LoadPoint(LoadKind.RATE, 5), seed=3)
    assert first != arrival_offsets(requests, LoadPoint(LoadKind.RATE, 5), seed=4)
    assert first[0] == 0.0
    # 999 gaps of mean 1/5 s
    assert first[-1] == pytest.approx(999 / 5, rel=0.1)


def test_trace_offsets_follow_timestamps_scaled_by_speed() -> None:
    requests = [BenchRequest("m", 1, prompt="p", timestamp=t) for t in (5.0, 5.5, 7.0)]
    # relative to 5.0, halved by speed 2
    assert arrival_offsets(requests, LoadPoint(LoadKind.TRACE, 2), 0) == [0.0, 0.25, 1.0]


def test_closed_loop_has_no_arrival_times() -> None:
    with pytest.raises(ValueError, match="closed-loop"):
        arrival_offsets(prompts(2), LoadPoint(LoadKind.CONCURRENCY, 2), 0)


async def test_plan_alternates_targets_isolates_prompts_and_reads_engines(
    aiohttp_server: ServerFactory,
) -> None:
    recorder = Recorder()
    url_a = await start(aiohttp_server, recorder.app("A"))
    url_b = await start(aiohttp_server, recorder.app("B", with_reset=False))
    plan = BenchPlan(
        targets=(Target("a", url_a), Target("b", url_b)),
        points=(LoadPoint(LoadKind.CONCURRENCY, 1),),
        options=NOT_STREAMED,
        rounds=2,
        max_requests=6,
        engines=(url_a, url_b),
        reset_cache=True,
    )
    runs = await run_plan(plan, prompts(10))
    # rounds of 3 requests (max_requests 6); round 1: a then b, round 2: b then a
    assert [s.server for s in recorder.log] == ["A"] * 3 + ["B"] * 6 + ["A"] * 3
    assert {s.text for s in recorder.log if s.server == "A"} == {f"<a#0> p{i}" for i in range(6)}
    assert {s.text for s in recorder.log if s.server == "B"} == {f"<b#0> p{i}" for i in range(6)}
    run_a, run_b = runs
    assert (run_a.target.name, len(run_a.results)) == ("a", 6)
    assert (run_b.target.name, len(run_b.results)) == ("b", 6)
    assert run_a.engine_deltas[url_a].requests == 6
    assert run_a.engine_deltas[url_b].requests == 0
    assert run_b.engine_deltas[url_b].requests == 6
    # one reset per engine before each of the 4 segments; engine B has no reset route
    assert recorder.resets == ["A"] * 4
    assert (run_a.cache_resets_failed, run_b.cache_resets_failed) == (2, 2)


async def test_plan_without_isolation_sends_identical_prompts(
    aiohttp_server: ServerFactory,
) -> None:
    recorder = Recorder()
    url = await start(aiohttp_server, recorder.app("A"))
    plan = BenchPlan(
        targets=(Target("a", url), Target("b", url)),
        points=(LoadPoint(LoadKind.CONCURRENCY, 2), LoadPoint(LoadKind.CONCURRENCY, 4)),
        options=NOT_STREAMED,
        rounds=1,
        isolate_targets=False,
    )
    runs = await run_plan(plan, prompts(4))
    assert [(r.target.name, r.point.label) for r in runs] == [
        ("a", "c=2"),
        ("b", "c=2"),
        ("a", "c=4"),
        ("b", "c=4"),
    ]
    assert sorted(s.text for s in recorder.log) == sorted([f"p{i}" for i in range(4)] * 4)


@pytest.mark.parametrize(
    ("count", "rounds", "sizes"),
    [
        pytest.param(10, 3, [4, 3, 3], id="uneven"),  # 10 = 3 x 3 + 1, extra goes first
        pytest.param(6, 2, [3, 3], id="even"),
        pytest.param(2, 3, [1, 1, 0], id="fewer-than-rounds"),
    ],
)
def test_split_rounds(count: int, rounds: int, sizes: list[int]) -> None:
    requests = prompts(count)
    chunks = split_rounds(requests, rounds)
    assert [len(c) for c in chunks] == sizes
    assert [r for chunk in chunks for r in chunk] == requests


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param(
            "gw=http://127.0.0.1:8080/", Target("gw", "http://127.0.0.1:8080"), id="named"
        ),
        pytest.param(
            "http://127.0.0.1:8080",
            Target("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
            id="bare-url",
        ),
    ],
)
def test_target_parse(spec: str, expected: Target) -> None:
    assert Target.parse(spec) == expected


@pytest.mark.parametrize("spec", ["gw=", "=http://x", "gw=ftp://x", "gw"])
def test_target_parse_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="name=http"):
        Target.parse(spec)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        pytest.param(LoadKind.CONCURRENCY, 0, id="zero-concurrency"),
        pytest.param(LoadKind.CONCURRENCY, 1.5, id="fractional-concurrency"),
        pytest.param(LoadKind.RATE, 0, id="zero-rate"),
        pytest.param(LoadKind.TRACE, -1, id="negative-speed"),
    ],
)
def test_load_point_rejects(kind: LoadKind, value: float) -> None:
    with pytest.raises(ValueError, match=r"."):
        LoadPoint(kind, value)


@pytest.mark.parametrize(
    ("point", "label"),
    [
        (LoadPoint(LoadKind.CONCURRENCY, 8), "c=8"),
        (LoadPoint(LoadKind.RATE, 2.5), "rate=2.5/s"),
        (LoadPoint(LoadKind.TRACE, 1), "trace@1x"),
    ],
)
def test_load_point_label(point: LoadPoint, label: str) -> None:
    assert point.label == label


A = Target("a", "http://127.0.0.1:1")
C1 = (LoadPoint(LoadKind.CONCURRENCY, 1),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"targets": (), "points": C1}, "at least one --target", id="no-targets"),
        pytest.param({"targets": (A, A), "points": C1}, "unique", id="duplicate-names"),
        pytest.param({"targets": (A,), "points": ()}, "load point", id="no-points"),
        pytest.param({"targets": (A,), "points": C1, "rounds": 0}, "rounds", id="zero-rounds"),
        pytest.param(
            {"targets": (A,), "points": C1, "reset_cache": True}, "--engine", id="reset-no-engine"
        ),
    ],
)
def test_plan_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchPlan(**kwargs)  # type: ignore[arg-type]


async def test_unreachable_engine_is_counted_not_fatal(aiohttp_server: ServerFactory) -> None:
    recorder = Recorder()
    url = await start(aiohttp_server, recorder.app("A"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    plan = BenchPlan(
        targets=(Target("a", url),),
        points=(LoadPoint(LoadKind.CONCURRENCY, 1),),
        options=NOT_STREAMED,
        rounds=2,
        engines=(closed,),
    )
    (run,) = await run_plan(plan, prompts(4))
    assert len(run.results) == 4
    assert run.engine_deltas[closed].failed_scrapes == 2  # one per segment
