"""List + watch of one Kubernetes collection, as client-go's reflector does it.

List once (the answer's `metadata.resourceVersion` is where the watch starts),
then watch from the last version seen — every event and every BOOKMARK moves it
forward. A watch the server ends (its `timeoutSeconds`) resumes from that
version; a 410 Gone (an HTTP status or an ERROR event: the version was
compacted away) lists again, and the full list replaces what the store held, so
objects deleted while nobody watched leave too. Failures back off exponentially
with jitter, reset by the first good answer.

With `absent_ok` (a custom resource whose CRD may not be installed), a 404 on the
list counts as an empty collection: the store is emptied, the reflector is synced,
and it lists again every `backoff.max_s`, logging the absence once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from servegate.pool.discovery.kubeapi import ApiGone, KubeApi, KubeApiError

log = logging.getLogger("servegate.discovery")

Replace = Callable[[Sequence[Mapping[str, Any]]], None]
Apply = Callable[[str, Mapping[str, Any]], None]


@dataclass(slots=True)
class Backoff:
    initial_s: float
    max_s: float
    rng: random.Random = field(default_factory=random.Random)
    _next: float = 0.0

    def reset(self) -> None:
        self._next = 0.0

    def next(self) -> float:
        """Seconds to wait: initial, doubling up to max, each with up to 20 % jitter."""
        self._next = self.initial_s if self._next == 0.0 else min(self.max_s, self._next * 2)
        return self._next * (1.0 + 0.2 * self.rng.random())


@dataclass(slots=True)
class ReflectorStats:
    lists: int = 0
    """Full lists, the first one included."""
    watches: int = 0
    """Watch requests opened."""
    events: int = 0
    """ADDED, MODIFIED and DELETED events applied."""
    bookmarks: int = 0
    gone: int = 0
    """410 Gone answers that forced a relist."""
    errors: int = 0
    """Failed requests and broken streams (each one backed off)."""
    resource_version: str | None = None
    synced: bool = False
    """A list has been applied at least once."""


def _rv(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None


class Reflector:
    def __init__(
        self,
        api: KubeApi,
        path: str,
        params: Mapping[str, str],
        replace: Replace,
        apply: Apply,
        backoff: Backoff,
        watch_timeout_s: int,
        what: str,
        absent_ok: bool = False,
    ) -> None:
        """`replace(items)` after each list, `apply(type, object)` per watch event."""
        self.api = api
        self.path = path
        self.params = dict(params)
        self.replace = replace
        self.apply = apply
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        self.what = what
        self.stats = ReflectorStats()
        self.synced = asyncio.Event()
        self._unproven = False
        self.absent_ok = absent_ok
        self.absent = False
        """The last list answered 404 (with `absent_ok`)."""

    async def _list(self) -> str:
        doc = await self.api.get(self.path, self.params)
        items = doc.get("items")
        if not isinstance(items, list):
            raise KubeApiError(f"list {self.path}: no `items` in the answer")
        rv = _rv(doc)
        if rv is None:
            raise KubeApiError(f"list {self.path}: no metadata.resourceVersion in the answer")
        self.replace([item for item in items if isinstance(item, Mapping)])
        self.stats.lists += 1
        self.stats.synced = True
        self.synced.set()
        self._unproven = True
        self.absent = False
        return rv

    async def _watch(self, rv: str) -> str:
        """Follow events from `rv`; the last version seen when the server ends the stream."""
        params = {
            **self.params,
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        self.stats.watches += 1
        async for event in self.api.watch(self.path, params):
            kind = event.get("type")
            obj = event.get("object")
            if not isinstance(obj, Mapping):
                raise KubeApiError(f"watch {self.path}: event without an object")
            if kind == "ERROR":
                code = obj.get("code")
                message = f"watch {self.path}: {obj.get('reason')}: {obj.get('message')}"
                if code == 410:
                    raise ApiGone(message)
                raise KubeApiError(message, code if isinstance(code, int) else 0)
            if kind == "BOOKMARK":
                self.stats.bookmarks += 1
            elif kind in ("ADDED", "MODIFIED", "DELETED"):
                self.apply(kind, obj)
                self.stats.events += 1
            else:
                raise KubeApiError(f"watch {self.path}: unknown event type {kind!r}")
            rv = _rv(obj) or rv
            self.stats.resource_version = rv
            self._unproven = False
            self.backoff.reset()
        return rv

    async def _absent(self, exc: KubeApiError) -> None:
        if not self.absent:
            log.info("%s: not served (%s); none until it is", self.what, exc)
        self.absent = True
        self.replace([])
        self.stats.synced = True
        self.synced.set()
        await asyncio.sleep(self.backoff.max_s)

    async def run(self) -> None:
        """Until cancelled: never raises for API trouble, only logs and backs off."""
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                    self.stats.resource_version = rv
                    self.backoff.reset()
                rv = await self._watch(rv)
            except ApiGone as exc:
                self.stats.gone += 1
                log.info("%s: %s; listing again", self.what, exc)
                rv = None
                if self._unproven:
                    await asyncio.sleep(self.backoff.next())
            except KubeApiError as exc:
                if rv is None and exc.status == 404 and self.absent_ok:
                    await self._absent(exc)
                    continue
                self.absent = False
                self.stats.errors += 1
                delay = self.backoff.next()
                log.warning("%s: %s; retrying in %.1f s", self.what, exc, delay)
                await asyncio.sleep(delay)
