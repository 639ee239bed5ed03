"""Ray discovery: the pool follows the model-server replicas of a Ray Serve application.

Ray Serve's own proxy spreads requests over replicas without looking at their
engines, so servegate's gateway addresses the replicas itself: each model-server
replica runs its engine on a port of its node and keeps a lease in a registry
deployment (`ReplicaRegistry`, one replica); the gateway polls that registry and
adds and removes endpoints as replicas come and go. The data layer then scrapes
each replica's own metrics, exactly as for any other endpoint.

A record that does not decode is skipped with a warning, never applied half; a
registry that cannot be reached keeps the current pool (its leases still
expire at the registry) and is asked again at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.pool.discovery.settings import RayDiscoverySettings
from servegate.pool.endpoint import Endpoint, Role
from servegate.pool.pool import Pool

log = logging.getLogger("servegate.discovery")


class ReplicaRecord(BaseModel):
    """What one model-server replica tells the registry about itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replica_id: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://[^/\s]+:\d+$")
    """`scheme://host:port` of the replica's engine."""
    engine: str = "vllm"
    model: str | None = None
    role: Role = Role.BOTH
    labels: dict[str, str] = Field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.url.split("://", 1)[1]

    def to_endpoint(self, pool: str) -> Endpoint:
        labels = {"servegate.io/ray-replica": self.replica_id, **self.labels}
        return Endpoint(
            address=self.address,
            url=self.url,
            engine=self.engine,
            role=self.role,
            model=self.model,
            labels=labels,
            pool=pool,
        )


class ReplicaRegistry:
    """Leases of live model-server replicas; the state of the registry deployment.

    A replica renews its lease every few seconds; one that stops renewing (killed,
    node lost) leaves the snapshot when its lease runs out, one that shuts down
    cleanly leaves at once.
    """

    def __init__(self, lease_s: float = 5.0) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.lease_s = lease_s
        self._leases: dict[str, tuple[float, dict[str, Any]]] = {}

    def register(self, record: Mapping[str, Any], now: float | None = None) -> None:
        decoded = ReplicaRecord.model_validate(dict(record))
        expires = (time.monotonic() if now is None else now) + self.lease_s
        self._leases[decoded.replica_id] = (expires, decoded.model_dump(mode="json"))

    def deregister(self, replica_id: str) -> None:
        self._leases.pop(replica_id, None)

    def snapshot(self, now: float | None = None) -> list[dict[str, Any]]:
        t = time.monotonic() if now is None else now
        for replica_id in [r for r, (exp, _) in self._leases.items() if exp <= t]:
            del self._leases[replica_id]
        return [record for _, record in self._leases.values()]


class ReplicaSource(Protocol):
    async def fetch(self) -> Sequence[Mapping[str, Any]]: ...


class ServeRegistrySource:
    """Reads the registry deployment through a Ray Serve handle (in a Ray worker)."""

    def __init__(self, settings: RayDiscoverySettings) -> None:
        self.settings = settings
        self._handle: Any = None

    def _registry(self) -> Any:
        if self._handle is None:
            serve = importlib.import_module("ray.serve")
            app = self.settings.app
            if app is None:
                app = serve.get_replica_context().app_name
            self._handle = serve.get_deployment_handle(self.settings.registry, app)
        return self._handle

    async def fetch(self) -> Sequence[Mapping[str, Any]]:
        response = self._registry().snapshot.remote()
        result = await asyncio.wait_for(response, self.settings.request_timeout_s)
        if not isinstance(result, list):
            raise TypeError(f"registry answered {type(result).__name__}, not a list")
        return result


def decode_records(raw: Sequence[object]) -> list[ReplicaRecord]:
    """The records that decode; each one that does not is logged and skipped."""
    records: list[ReplicaRecord] = []
    for item in raw:
        try:
            records.append(ReplicaRecord.model_validate(item))
        except ValidationError as exc:
            log.warning("ray discovery: skipping a replica record: %s", exc)
    return records


class RayDiscovery:
    def __init__(self, settings: RayDiscoverySettings, pool: Pool, source: ReplicaSource) -> None:
        self.settings = settings
        self.pool = pool
        self.source = source
        self._endpoints: dict[str, Endpoint] = {}
        self._task: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()
        self.errors = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        log.info("ray discovery started", extra={"fields": {"registry": self.settings.registry}})

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def endpoints(self) -> dict[str, Endpoint]:
        """Address → endpoint, for the replicas this source put into the pool."""
        return dict(self._endpoints)

    async def poll_once(self) -> None:
        raw = await self.source.fetch()
        self.apply(decode_records(raw))
        self.synced.set()

    def apply(self, records: Sequence[ReplicaRecord]) -> None:
        wanted = {r.address: r.to_endpoint(self.pool.name) for r in records}
        for address in [a for a in self._endpoints if a not in wanted]:
            del self._endpoints[address]
            self.pool.remove(address)
            log.info("ray replica left", extra={"fields": {"address": address}})
        for address, endpoint in wanted.items():
            if self._endpoints.get(address) != endpoint:
                self._endpoints[address] = endpoint
                self.pool.add(endpoint)
                log.info("ray replica joined", extra={"fields": {"address": address}})

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of a remote call: keep the pool, retry
                self.errors += 1
                log.warning("ray discovery: registry not readable: %s", exc)
            await asyncio.sleep(self.settings.poll_interval_s)
