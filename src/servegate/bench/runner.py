"""Load shapes and the comparison schedule.

`run_segment` sends a list of requests to one URL under one load point:
- `concurrency` N: a closed loop of N workers, each sending its next request when the
  previous one finished;
- `rate` λ: an open loop with Poisson arrivals (seeded, so every target gets the same
  arrival times);
- `trace`: the requests' own timestamps.
No new request starts after the segment's deadline; requests already sent finish (or
hit their timeout). Requests of one `x-session-id` go out in order, each after the
previous one of its session finished.

`run_plan` compares targets: for each load point the workload is cut into `rounds`
consecutive chunks, and every round runs every target on that chunk, the order of
targets rotating by one each round, so slow drift of the machine (thermal state, noisy
neighbours, cache warm-up) hits every target alike. Engine counters are read and, with
`reset_cache`, prefix caches cleared, around each target's segment.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import aiohttp

from servegate.bench.client import RequestResult, send_request
from servegate.bench.engine_counters import (
    EngineCounters,
    EngineDelta,
    reset_prefix_cache,
    scrape_counters,
)
from servegate.bench.workloads import BenchRequest


class LoadKind(StrEnum):
    CONCURRENCY = "concurrency"
    RATE = "rate"
    TRACE = "trace"


@dataclass(frozen=True, slots=True)
class LoadPoint:
    kind: LoadKind
    value: float = 0.0
    """Workers (`concurrency`), requests/s (`rate`) or a speed-up of recorded time (`trace`)."""

    def __post_init__(self) -> None:
        if self.kind is LoadKind.CONCURRENCY and (self.value < 1 or self.value != int(self.value)):
            raise ValueError(f"concurrency must be a whole number >= 1, got {self.value}")
        if self.kind is not LoadKind.CONCURRENCY and self.value <= 0:
            raise ValueError(f"{self.kind} value must be > 0, got {self.value}")

    @property
    def label(self) -> str:
        if self.kind is LoadKind.CONCURRENCY:
            return f"c={int(self.value)}"
        if self.kind is LoadKind.RATE:
            return f"rate={self.value:g}/s"
        return f"trace@{self.value:g}x"


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str

    @classmethod
    def parse(cls, spec: str) -> Target:
        """`name=URL`; a bare URL names itself."""
        name, sep, url = spec.partition("=")
        if not sep:
            name, url = spec, spec
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--target {spec!r}: expected name=http://host:port")
        return cls(name, url.rstrip("/"))


class ProgressSink(Protocol):
    def start(self, description: str, total: int) -> None: ...

    def advance(self, result: RequestResult) -> None: ...


class NullProgress:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, result: RequestResult) -> None:
        pass


@dataclass(frozen=True, slots=True)
class SendOptions:
    stream: bool = True
    ignore_eos: bool = False
    timeout_s: float = 300.0


@dataclass(slots=True)
class SegmentResult:
    results: list[RequestResult]
    wall_s: float


class _SessionOrder:
    """Makes each request of a session wait for the previous one of that session."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Event] = {}

    def claim(self, request: BenchRequest) -> tuple[asyncio.Event | None, asyncio.Event | None]:
        session = request.session_id
        if session is None:
            return None, None
        previous = self._last.get(session)
        done = asyncio.Event()
        self._last[session] = done
        return previous, done


def arrival_offsets(requests: Sequence[BenchRequest], point: LoadPoint, seed: int) -> list[float]:
    """Seconds after the segment start at which each request is due (open loops)."""
    if point.kind is LoadKind.RATE:
        rng = random.Random(seed)
        offsets, now = [], 0.0
        for index in range(len(requests)):
            if index:
                now += rng.expovariate(point.value)
            offsets.append(now)
        return offsets
    if point.kind is LoadKind.TRACE:
        origin = min((r.timestamp for r in requests), default=0.0)
        return [(r.timestamp - origin) / point.value for r in requests]
    raise ValueError("closed-loop (concurrency) segments have no arrival times")


async def run_segment(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[BenchRequest],
    point: LoadPoint,
    *,
    options: SendOptions,
    duration_s: float,
    seed: int = 0,
    on_result: Callable[[RequestResult], None] | None = None,
) -> SegmentResult:
    results: list[RequestResult] = []
    order = _SessionOrder()
    started = time.perf_counter()
    deadline = started + duration_s

    async def send(request: BenchRequest) -> None:
        previous, done = order.claim(request)
        try:
            if previous is not None:
                await previous.wait()
            result = await send_request(
                session,
                url,
                request,
                stream=options.stream,
                ignore_eos=options.ignore_eos,
                timeout_s=options.timeout_s,
            )
        finally:
            if done is not None:
                done.set()
        results.append(result)
        if on_result is not None:
            on_result(result)

    if point.kind is LoadKind.CONCURRENCY:
        pending = iter(requests)

        async def worker() -> None:
            for request in pending:
                if time.perf_counter() >= deadline:
                    return
                await send(request)

        await asyncio.gather(*(worker() for _ in range(int(point.value))))
    else:
        tasks: list[asyncio.Task[None]] = []
        for request, offset in zip(requests, arrival_offsets(requests, point, seed), strict=True):
            due = started + offset
            if due >= deadline:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request)))
        await asyncio.gather(*tasks)
    return SegmentResult(results, time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class BenchPlan:
    targets: tuple[Target, ...]
    points: tuple[LoadPoint, ...]
    options: SendOptions = SendOptions()
    rounds: int = 3
    max_requests: int = 1000
    duration_s: float = 120.0
    """Time limit per target and load point, shared by its rounds."""
    engines: tuple[str, ...] = ()
    reset_cache: bool = False
    isolate_targets: bool = True
    """Prefix each target's prompts with a tag of its own, so targets sharing replicas
    cannot reuse each other's cached prefixes."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("give at least one --target name=URL")
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique, got {names}")
        if not self.points:
            raise ValueError("give at least one load point (--concurrency or --rate)")
        if self.rounds < 1 or self.max_requests < 1 or self.duration_s <= 0:
            raise ValueError("rounds and max_requests must be >= 1 and duration_s > 0")
        if self.reset_cache and not self.engines:
            raise ValueError("--reset-cache needs the replicas' URLs (--engine URL)")


@dataclass(slots=True)
class RoundRecord:
    """What one round of one target measured: the unit of the confidence intervals."""

    index: int
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    engine_deltas: dict[str, EngineDelta] = field(default_factory=dict)


@dataclass(slots=True)
class TargetRun:
    """Everything measured for one target at one load point, over all its rounds."""

    target: Target
    point: LoadPoint
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    engine_deltas: dict[str, EngineDelta] = field(default_factory=dict)
    cache_resets_failed: int = 0
    rounds: list[RoundRecord] = field(default_factory=list)
    """The same measurements round by round (`results` etc. are their sums)."""

    def round_run(self, record: RoundRecord) -> TargetRun:
        """One round as a run of its own, for per-round summaries."""
        return TargetRun(
            self.target,
            self.point,
            list(record.results),
            record.wall_s,
            dict(record.engine_deltas),
            0,
            [record],
        )


def split_rounds(requests: Sequence[BenchRequest], rounds: int) -> list[list[BenchRequest]]:
    """`rounds` consecutive chunks whose sizes differ by at most one."""
    size, extra = divmod(len(requests), rounds)
    chunks, start = [], 0
    for index in range(rounds):
        end = start + size + (1 if index < extra else 0)
        chunks.append(list(requests[start:end]))
        start = end
    return chunks


def isolation_tag(target: Target, point_index: int) -> str:
    return f"<{target.name}#{point_index}> "


async def _snapshot(
    session: aiohttp.ClientSession, engines: Sequence[str]
) -> list[EngineCounters | None]:
    return list(await asyncio.gather(*(scrape_counters(session, url) for url in engines)))


async def run_plan(
    plan: BenchPlan,
    requests: Sequence[BenchRequest],
    *,
    progress: ProgressSink | None = None,
) -> list[TargetRun]:
    """Runs every target at every load point; returns runs in (point, target) order."""
    sink = progress or NullProgress()
    chunks = split_rounds(list(requests[: plan.max_requests]), plan.rounds)
    runs: list[TargetRun] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        for point_index, point in enumerate(plan.points):
            point_runs = [TargetRun(target, point) for target in plan.targets]
            for round_index, chunk in enumerate(chunks):
                if not chunk:
                    continue
                count = len(plan.targets)
                order = [(round_index + k) % count for k in range(count)]
                for target_index in order:
                    run = point_runs[target_index]
                    batch = chunk
                    if plan.isolate_targets:
                        tag = isolation_tag(run.target, point_index)
                        batch = [request.tagged(tag) for request in chunk]
                    await _run_one(session, plan, run, batch, point_index, round_index, sink)
            runs.extend(point_runs)
    return runs


async def _run_one(
    session: aiohttp.ClientSession,
    plan: BenchPlan,
    run: TargetRun,
    batch: Sequence[BenchRequest],
    point_index: int,
    round_index: int,
    sink: ProgressSink,
) -> None:
    if plan.reset_cache:
        reset = await asyncio.gather(*(reset_prefix_cache(session, url) for url in plan.engines))
        run.cache_resets_failed += reset.count(False)
    before = await _snapshot(session, plan.engines)
    sink.start(
        f"{run.target.name} {run.point.label} round {round_index + 1}/{plan.rounds}", len(batch)
    )
    segment = await run_segment(
        session,
        run.target.url,
        batch,
        run.point,
        options=plan.options,
        duration_s=plan.duration_s / plan.rounds,
        seed=plan.seed * 1000 + point_index * 100 + round_index,
        on_result=sink.advance,
    )
    after = await _snapshot(session, plan.engines)
    run.results.extend(segment.results)
    run.wall_s += segment.wall_s
    record = RoundRecord(round_index, list(segment.results), segment.wall_s)
    for url, first, last in zip(plan.engines, before, after, strict=True):
        run.engine_deltas.setdefault(url, EngineDelta()).add(first, last)
        record.engine_deltas.setdefault(url, EngineDelta()).add(first, last)
    run.rounds.append(record)
