from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from fake_replica import FakeReplica, wait_until

from servegate.datalayer.health import HealthChecker, HealthSettings, parse_models
from servegate.datalayer.scraper import FetchError
from servegate.engines import builtin_engines
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.pool.pool import ModelEntry, Pool

ENGINES = builtin_engines()
VLLM_MODELS: list[dict[str, object]] = [
    {
        "id": "tiny",
        "object": "model",
        "root": "/models/tiny",
        "parent": None,
        "max_model_len": 2048,
    },
    {"id": "a1", "object": "model", "root": "/loras/a1", "parent": "tiny"},
]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    server = await FakeReplica(models=VLLM_MODELS).start()
    yield server
    await server.stop()


def make_checker(
    replica: FakeReplica,
    session: aiohttp.ClientSession,
    engine: str = "vllm",
    **settings: float,
) -> tuple[Pool, EndpointState, HealthChecker]:
    pool = Pool()
    endpoint = Endpoint(replica.address, replica.url, engine=engine)
    state = pool.add(endpoint)
    defaults: dict[str, float] = {"interval_s": 0.05, "timeout_s": 0.3}
    checker = HealthChecker(
        pool,
        session,
        endpoint,
        ENGINES[engine],
        HealthSettings(**(defaults | settings)),  # type: ignore[arg-type]
    )
    return pool, state, checker


async def test_first_good_probe_reads_models_then_turns_healthy(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    pool, state, checker = make_checker(replica, session)
    assert not state.healthy
    assert await checker.probe_once()
    assert state.healthy
    assert state.served_models == frozenset({"tiny", "a1"})
    assert pool.resolve_model("a1") == ModelEntry("a1", "tiny")
    assert pool.resolve_model("tiny") == ModelEntry("tiny")
    assert pool.candidates("tiny", now=0.0) == [state]
    assert replica.requests == {"/health": 1, "/v1/models": 1}


@pytest.mark.parametrize(
    ("failure_threshold", "success_threshold", "script", "verdicts"),
    [
        # one bad probe is tolerated with failure_threshold 2; the second flips
        pytest.param(2, 1, [200, 503, 503, 200], [True, True, False, True], id="fail-2"),
        pytest.param(1, 1, [200, 503, 200], [True, False, True], id="fail-1"),
        # two good probes in a row are needed with success_threshold 2
        pytest.param(
            1,
            2,
            [200, 200, 503, 200, 503, 200, 200],
            [False, True, False, False, False, False, True],
            id="succeed-2",
        ),
    ],
)
async def test_thresholds(
    replica: FakeReplica,
    session: aiohttp.ClientSession,
    failure_threshold: int,
    success_threshold: int,
    script: list[int],
    verdicts: list[bool],
) -> None:
    _, state, checker = make_checker(
        replica,
        session,
        failure_threshold=failure_threshold,
        success_threshold=success_threshold,
    )
    seen = []
    for status in script:
        replica.health_status = status
        await checker.probe_once()
        seen.append(state.healthy)
    assert seen == verdicts
    assert checker.stats.healthy == verdicts[-1]
    assert checker.stats.failures == {"http_status": script.count(503)}


async def test_triton_readiness_and_no_models(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, state, checker = make_checker(replica, session, "triton-tensorrt-llm")
    assert checker.url == f"{replica.url}/v2/health/ready"
    replica.health_status = 400  # Triton: not ready
    assert not await checker.probe_once()
    assert not state.healthy
    replica.health_status = 200
    assert await checker.probe_once()
    assert state.healthy
    assert replica.requests["/v1/models"] == 0
    assert state.served_models == frozenset()


async def test_models_are_refreshed_every_n_good_probes(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, state, checker = make_checker(replica, session, models_refresh_every=3)
    await checker.probe_once()  # probe 1 reads the list
    replica.set_models([*VLLM_MODELS, {"id": "a2", "parent": "tiny"}])
    await checker.probe_once()  # 2
    await checker.probe_once()  # 3
    assert state.served_models == frozenset({"tiny", "a1"})
    await checker.probe_once()  # 4: three good probes since the last read
    assert state.served_models == frozenset({"tiny", "a1", "a2"})
    assert replica.requests["/v1/models"] == 2
    assert checker.stats.model_refreshes == 2


async def test_bad_model_list_does_not_block_health(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, state, checker = make_checker(replica, session)
    replica.models_body = b"{not json"
    assert await checker.probe_once()
    assert state.healthy
    assert checker.models is None
    assert checker.stats.model_failures == {"invalid": 1}
    replica.set_models(VLLM_MODELS)
    await checker.probe_once()  # retried on the next good probe until it succeeds
    assert state.served_models == frozenset({"tiny", "a1"})


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        pytest.param("down", "connection", id="server-down"),
        pytest.param("slow", "timeout", id="timeout"),
    ],
)
async def test_probe_failures(
    replica: FakeReplica, session: aiohttp.ClientSession, breakage: str, reason: str
) -> None:
    _, state, checker = make_checker(replica, session, failure_threshold=1)
    await checker.probe_once()
    assert state.healthy
    if breakage == "down":
        await replica.stop()
    else:
        replica.delay = 0.5  # > timeout 0.3
    assert not await checker.probe_once()
    assert not state.healthy
    assert checker.stats.failures == {reason: 1}
    assert checker.stats.transitions == 2


async def test_run_flips_with_the_server(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, state, checker = make_checker(replica, session)
    task = asyncio.create_task(checker.run())
    try:
        await wait_until(lambda: state.healthy)
        await replica.stop()
        await wait_until(lambda: not state.healthy)
        assert checker.stats.consecutive_failures >= 2
        await replica.start()
        await wait_until(lambda: state.healthy)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            {"object": "list", "data": VLLM_MODELS},
            (ModelEntry("tiny"), ModelEntry("a1", "tiny")),
            id="vllm-with-lora",
        ),
        pytest.param({"data": []}, (), id="empty"),
        pytest.param(
            {"data": [{"id": ""}, {"name": "x"}, "tiny", {"id": "m", "parent": "m"}]},
            (ModelEntry("m"),),
            id="junk-entries-skipped-self-parent",
        ),
        pytest.param(
            {"data": [{"id": "m", "parent": 3}, {"id": "m"}]}, (ModelEntry("m"),), id="duplicates"
        ),
    ],
)
def test_parse_models(body: object, expected: tuple[ModelEntry, ...]) -> None:
    assert parse_models(orjson.dumps(body)) == expected


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"[]", id="list"),
        pytest.param(b'{"data": {}}', id="data-not-list"),
    ],
)
def test_parse_models_errors(body: bytes) -> None:
    with pytest.raises(FetchError) as info:
        parse_models(body)
    assert info.value.reason == "invalid"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"interval_s": 0.0}, r"interval_s\n.*greater than or equal to 0.05", id="interval"
        ),
        pytest.param({"timeout_s": -1.0}, r"timeout_s\n.*greater than 0", id="timeout"),
        pytest.param(
            {"failure_threshold": 0},
            r"failure_threshold\n.*greater than or equal to 1",
            id="failure-threshold",
        ),
        pytest.param(
            {"success_threshold": 0},
            r"success_threshold\n.*greater than or equal to 1",
            id="success-threshold",
        ),
        pytest.param(
            {"models_refresh_every": 0},
            r"models_refresh_every\n.*greater than or equal to 1",
            id="models-every",
        ),
    ],
)
def test_settings_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HealthSettings(**kwargs)  # type: ignore[arg-type]
