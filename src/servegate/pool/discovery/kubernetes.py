"""Kubernetes discovery: the pool follows the ready pods a selector (or an InferencePool) names.

One `Reflector` watches the pods (`labelSelector` applied by the API server);
each pod maps to one endpoint per target port while it is ready. With
`inference_pool`, a second reflector watches that InferencePool object and,
whenever its selector or ports change, the pod watch restarts with the new ones:
its first list reconciles the pool, so endpoints that still match never leave.
Endpoints join and leave the `Pool` in place; the data layer follows the pool.

An address belongs to the pod that claimed it last: a pod IP reused by a new pod
before the old pod's DELETED event arrives is not dropped by that late event.

Two more reflectors follow the namespace's InferenceObjectives and
InferenceModelRewrites into `policy` (policy.py), which the gateway applies; a
cluster without their CRD answers 404 and simply has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from servegate.pool.discovery.kubeapi import KubeApi
from servegate.pool.discovery.pods import Target, inference_pool_target, pod_endpoints, pod_name
from servegate.pool.discovery.policy import ClusterPolicy
from servegate.pool.discovery.reflector import Backoff, Reflector, ReflectorStats
from servegate.pool.discovery.settings import KubernetesDiscoverySettings
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool

log = logging.getLogger("servegate.discovery")


class KubernetesDiscovery:
    def __init__(
        self,
        settings: KubernetesDiscoverySettings,
        pool: Pool,
        api: KubeApi,
        namespace: str,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.api = api
        self.namespace = namespace
        self.target: Target | None = None
        if settings.selector is not None:
            self.target = Target(settings.selector, settings.target_ports)
        self.pods = self._pods_reflector()
        self.inference_pool: Reflector | None = None
        if settings.inference_pool is not None:
            self.inference_pool = self._pool_reflector(settings.inference_pool)
        self.policy: ClusterPolicy | None = None
        self.policy_reflectors: list[Reflector] = []
        if settings.watch_objectives or settings.watch_model_rewrites:
            self.policy = ClusterPolicy(settings.inference_pool or pool.name, pool.name)
            if settings.watch_objectives:
                self.policy_reflectors.append(
                    self._policy_reflector("inferenceobjectives", "InferenceObjective")
                )
            if settings.watch_model_rewrites:
                self.policy_reflectors.append(
                    self._policy_reflector("inferencemodelrewrites", "InferenceModelRewrite")
                )
        self._policy_tasks: list[asyncio.Task[None]] = []
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._owner: dict[str, str] = {}
        self._pod_task: asyncio.Task[None] | None = None
        self._pool_task: asyncio.Task[None] | None = None
        self._retired: set[asyncio.Task[None]] = set()
        self.restarts = 0
        """Pod watches restarted because the InferencePool's selector or ports changed."""

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self.inference_pool is not None:
            self._pool_task = asyncio.create_task(self.inference_pool.run())
        elif self.target is not None:
            self._pod_task = asyncio.create_task(self.pods.run())
        self._policy_tasks = [asyncio.create_task(r.run()) for r in self.policy_reflectors]
        log.info(
            "kubernetes discovery started",
            extra={"fields": {"namespace": self.namespace, "target": self._describe()}},
        )

    async def stop(self) -> None:
        tasks = [
            t
            for t in (self._pool_task, self._pod_task, *self._retired, *self._policy_tasks)
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pool_task = self._pod_task = None
        self._retired.clear()
        self._policy_tasks = []
        await self.api.close()

    async def wait_synced(self, timeout: float) -> bool:
        """True once the pod list has been applied (and the InferencePool read, if any)."""
        try:
            await asyncio.wait_for(self.pods.synced.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def stats(self) -> ReflectorStats:
        return self.pods.stats

    def endpoints(self) -> dict[str, tuple[Endpoint, ...]]:
        """Pod name → its endpoints in the pool (ready pods only)."""
        return dict(self._endpoints)

    # -- pods -----------------------------------------------------------------------
    def _pods_reflector(self) -> Reflector:
        params = {"labelSelector": self.target.selector.to_query()} if self.target else {}
        return Reflector(
            self.api,
            f"/api/v1/namespaces/{quote(self.namespace, safe='')}/pods",
            params,
            self._replace_pods,
            self._apply_pod,
            Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s),
            self.settings.watch_timeout_s,
            f"pods in {self.namespace}",
        )

    def _endpoints_of(self, pod: Mapping[str, Any]) -> tuple[Endpoint, ...]:
        if self.target is None:
            return ()
        return pod_endpoints(pod, self.target, self.settings, self.pool.name)

    def _replace_pods(self, items: Sequence[Mapping[str, Any]]) -> None:
        seen: set[str] = set()
        for pod in items:
            name = pod_name(pod)
            if name is not None:
                seen.add(name)
                self._set(name, self._endpoints_of(pod))
        for name in list(self._endpoints):
            if name not in seen:
                self._set(name, ())

    def _apply_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        name = pod_name(pod)
        if name is None:
            return
        self._set(name, () if kind == "DELETED" else self._endpoints_of(pod))

    def _set(self, name: str, endpoints: tuple[Endpoint, ...]) -> None:
        old = self._endpoints.get(name, ())
        if old == endpoints:
            return
        keep = {ep.address for ep in endpoints}
        for ep in old:
            if ep.address not in keep and self._owner.get(ep.address) == name:
                del self._owner[ep.address]
                self.pool.remove(ep.address)
        for ep in endpoints:
            previous = self._owner.get(ep.address)
            if previous is not None and previous != name:
                rest = tuple(
                    e for e in self._endpoints.get(previous, ()) if e.address != ep.address
                )
                self._store(previous, rest)
            self._owner[ep.address] = name
            self.pool.add(ep)
        self._store(name, endpoints)
        log.info(
            "pod endpoints changed",
            extra={"fields": {"pod": name, "endpoints": [e.address for e in endpoints]}},
        )

    def _store(self, name: str, endpoints: tuple[Endpoint, ...]) -> None:
        if endpoints:
            self._endpoints[name] = endpoints
        else:
            self._endpoints.pop(name, None)

    # -- objectives and model rewrites ---------------------------------------------------
    def _policy_reflector(self, resource: str, kind: str) -> Reflector:
        assert self.policy is not None
        path = (
            f"/apis/{self.settings.extension_api}/namespaces/"
            f"{quote(self.namespace, safe='')}/{resource}"
        )
        return Reflector(
            self.api,
            path,
            {},
            self.policy.replacer(kind),
            self.policy.applier(kind),
            Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s),
            self.settings.watch_timeout_s,
            f"{kind}s in {self.namespace}",
            absent_ok=True,
        )

    # -- the InferencePool ------------------------------------------------------------
    def _pool_reflector(self, name: str) -> Reflector:
        api_version = self.settings.inference_pool_api
        path = f"/apis/{api_version}/namespaces/{quote(self.namespace, safe='')}/inferencepools"
        return Reflector(
            self.api,
            path,
            {"fieldSelector": f"metadata.name={name}"},
            self._replace_pool,
            self._apply_pool,
            Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s),
            self.settings.watch_timeout_s,
            f"InferencePool {self.namespace}/{name}",
        )

    def _replace_pool(self, items: Sequence[Mapping[str, Any]]) -> None:
        wanted = self.settings.inference_pool
        match = [item for item in items if pod_name(item) == wanted]
        self._retarget(match[0] if match else None)

    def _apply_pool(self, kind: str, obj: Mapping[str, Any]) -> None:
        if pod_name(obj) == self.settings.inference_pool:
            self._retarget(None if kind == "DELETED" else obj)

    def _retarget(self, obj: Mapping[str, Any] | None) -> None:
        target: Target | None = None
        if obj is not None:
            try:
                target = inference_pool_target(obj)
            except ValueError as exc:
                log.warning(
                    "InferencePool %s cannot be used: %s", self.settings.inference_pool, exc
                )
        elif self.target is not None:
            log.warning("InferencePool %s is gone", self.settings.inference_pool)
        if target == self.target and (target is None or self._pod_task is not None):
            return
        self.target = target
        if self._pod_task is not None:
            self._pod_task.cancel()
            self._retired.add(self._pod_task)
            self._pod_task.add_done_callback(self._retired.discard)
            self._pod_task = None
            self.restarts += 1
        if target is None:
            for name in list(self._endpoints):
                self._set(name, ())
            return
        stats = self.pods.stats
        self.pods = self._pods_reflector()
        self.pods.stats = stats
        self._pod_task = asyncio.create_task(self.pods.run())
        log.info("watching pods", extra={"fields": {"target": self._describe()}})

    def _describe(self) -> str:
        if self.target is None:
            return f"InferencePool {self.settings.inference_pool} (not read yet)"
        return f"{self.target.selector.to_query()} ports {list(self.target.ports)}"
