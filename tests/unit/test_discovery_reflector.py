"""The list/watch loop against a scripted API: each call takes the next scripted answer."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest

from servegate.pool.discovery.kubeapi import JSON, ApiGone, KubeApiError
from servegate.pool.discovery.reflector import Backoff, Reflector


def obj(name: str, rv: int) -> JSON:
    return {"metadata": {"name": name, "resourceVersion": str(rv)}}


def listing(rv: int, *names: str) -> JSON:
    return {"metadata": {"resourceVersion": str(rv)}, "items": [obj(n, rv) for n in names]}


class ScriptedApi:
    """`gets`: answers (or exceptions) to lists; `watches`: event lists (or exceptions)."""

    def __init__(self, gets: list[JSON | Exception], watches: list[list[JSON] | Exception]) -> None:
        self.gets = gets
        self.watches = watches
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.done = asyncio.Event()

    async def get(self, path: str, params: Mapping[str, str]) -> JSON:
        self.calls.append(("get", dict(params)))
        if not self.gets:
            self.done.set()
            await asyncio.Event().wait()
        answer = self.gets.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[JSON]:
        self.calls.append(("watch", dict(params)))
        if not self.watches:
            self.done.set()
            await asyncio.Event().wait()
        answer = self.watches.pop(0)
        if isinstance(answer, Exception):
            raise answer
        for event in answer:
            yield event

    async def close(self) -> None:
        return None


class Store:
    def __init__(self) -> None:
        self.names: set[str] = set()
        self.log: list[str] = []

    def replace(self, items: Sequence[Mapping[str, Any]]) -> None:
        self.names = {i["metadata"]["name"] for i in items}
        self.log.append("list:" + ",".join(sorted(self.names)))

    def apply(self, kind: str, o: Mapping[str, Any]) -> None:
        name = o["metadata"]["name"]
        if kind == "DELETED":
            self.names.discard(name)
        else:
            self.names.add(name)
        self.log.append(f"{kind}:{name}")


async def run(api: ScriptedApi) -> tuple[Reflector, Store]:
    store = Store()
    reflector = Reflector(
        api,
        "/api/v1/namespaces/d/pods",
        {"labelSelector": "app=x"},
        store.replace,
        store.apply,
        Backoff(0.001, 0.002),
        60,
        "test",
    )
    task = asyncio.create_task(reflector.run())
    await asyncio.wait_for(api.done.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return reflector, store


def ev(kind: str, name: str, rv: int) -> JSON:
    return {"type": kind, "object": obj(name, rv)}


def gone_event() -> JSON:
    return {
        "type": "ERROR",
        "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
    }


def bookmark(rv: int) -> JSON:
    return {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": str(rv)}}}


async def test_list_then_watch_from_the_list_version() -> None:
    api = ScriptedApi([listing(10, "a")], [[ev("ADDED", "b", 11), ev("DELETED", "a", 12)]])
    reflector, store = await run(api)
    assert store.log == ["list:a", "ADDED:b", "DELETED:a"]
    assert store.names == {"b"}
    watch_params = [p for kind, p in api.calls if kind == "watch"]
    assert watch_params[0] == {
        "labelSelector": "app=x",
        "watch": "true",
        "resourceVersion": "10",
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "60",
    }
    # the stream ended cleanly: re-watch from the last event's version, no relist
    assert watch_params[1]["resourceVersion"] == "12"
    assert reflector.stats.lists == 1


async def test_bookmark_moves_the_version_without_an_event() -> None:
    api = ScriptedApi([listing(10)], [[bookmark(50)]])
    reflector, store = await run(api)
    assert store.log == ["list:"]
    assert [p["resourceVersion"] for k, p in api.calls if k == "watch"] == ["10", "50"]
    assert reflector.stats.bookmarks == 1


@pytest.mark.parametrize(
    "gone",
    [
        pytest.param([ev("ADDED", "b", 11), gone_event()], id="error-event"),
        pytest.param(ApiGone("HTTP 410"), id="http-410"),
    ],
)
async def test_410_gone_lists_again_and_the_list_replaces_the_store(
    gone: list[JSON] | Exception,
) -> None:
    api = ScriptedApi([listing(10, "a", "b"), listing(20, "c")], [gone])
    reflector, store = await run(api)
    # a and b vanished while the watch was gone: the relist drops them
    assert store.names == {"c"}
    assert store.log[-1] == "list:c"
    assert reflector.stats.gone == 1
    assert [p["resourceVersion"] for k, p in api.calls if k == "watch"][-1] == "20"


async def test_errors_back_off_and_retry_from_the_same_version() -> None:
    api = ScriptedApi(
        [KubeApiError("refused"), listing(10, "a")],
        [KubeApiError("HTTP 500", 500), [ev("MODIFIED", "a", 11)]],
    )
    reflector, store = await run(api)
    assert store.log == ["list:a", "MODIFIED:a"]
    assert reflector.stats.errors == 2
    # after the failed watch, the next one resumes from 10: no relist
    assert [p["resourceVersion"] for k, p in api.calls if k == "watch"] == ["10", "10", "11"]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"metadata": {}, "items": []}, id="no-version"),
        pytest.param({"metadata": {"resourceVersion": "1"}}, id="no-items"),
    ],
)
async def test_a_malformed_list_is_an_error_not_a_crash(bad: JSON) -> None:
    api = ScriptedApi([bad, listing(10, "a")], [])
    reflector, store = await run(api)
    assert store.names == {"a"}
    assert reflector.stats.errors == 1


@pytest.mark.parametrize(
    "events",
    [
        pytest.param([{"type": "WHAT", "object": obj("a", 3)}], id="unknown-type"),
        pytest.param([{"type": "ADDED", "object": "text"}], id="object-not-a-map"),
        pytest.param(
            [{"type": "ERROR", "object": {"code": 500, "reason": "x", "message": "y"}}],
            id="error-500",
        ),
    ],
)
async def test_malformed_events_are_errors_not_crashes(events: list[JSON]) -> None:
    api = ScriptedApi([listing(10, "a")], [events, [ev("ADDED", "b", 11)]])
    reflector, store = await run(api)
    assert store.names == {"a", "b"}
    assert reflector.stats.errors == 1


BACKOFF_CASES = [
    # initial 1, doubling, capped at 8; each with at most 20 % jitter
    pytest.param(6, [1, 2, 4, 8, 8, 8], id="doubles-to-cap"),
]


@pytest.mark.parametrize(("n", "bases"), BACKOFF_CASES)
def test_backoff(n: int, bases: list[float]) -> None:
    backoff = Backoff(1.0, 8.0, rng=random.Random(1))
    delays = [backoff.next() for _ in range(n)]
    for delay, base in zip(delays, bases, strict=True):
        assert base <= delay <= base * 1.2
    backoff.reset()
    assert 1.0 <= backoff.next() <= 1.2
