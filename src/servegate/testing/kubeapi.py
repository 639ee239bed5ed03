"""A Kubernetes API server stand-in that speaks the real list/watch protocol.

No cluster runs on a laptop or in CI, so discovery is tested against this: real
HTTP on 127.0.0.1, the API paths, `PodList` answers with
`metadata.resourceVersion`, and chunked watch streams of `{"type","object"}`
lines — ADDED, MODIFIED, DELETED, BOOKMARK and ERROR with a `Status` object,
replay from a `resourceVersion`, 410 Gone once history is compacted, and the
filtered-watch rule of the real API server (an object that stops matching a
`labelSelector` arrives as DELETED, one that starts matching as ADDED).

Besides pods and InferencePools it serves the Gateway API Inference Extension's
InferenceObjectives and InferenceModelRewrites, at their one real group/version
(`inference.networking.x-k8s.io/v1alpha2`): any other version is a 404, and so is
every path of a CRD left out of `crds` (not installed in this cluster).

    async with FakeKubeApi(token="t") as api:
        api.write_kubeconfig(path, namespace="llm")
        api.add_pod("vllm-0", "127.0.0.1", {"app": "vllm"}, ready=True)
        api.set_objective("batch", priority=-1, pool="qwen-pool")
        api.expire()            # open watches get ERROR 410; old versions are gone
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

JSON = dict[str, Any]
POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
X_GROUP = "inference.networking.x-k8s.io"
X_VERSION = "v1alpha2"
KINDS = {
    "pods": ("Pod", "PodList"),
    "inferencepools": ("InferencePool", "InferencePoolList"),
    "inferenceobjectives": ("InferenceObjective", "InferenceObjectiveList"),
    "inferencemodelrewrites": ("InferenceModelRewrite", "InferenceModelRewriteList"),
}
API_VERSIONS = {"pods": "v1", "inferencepools": f"{POOL_GROUP}/{POOL_VERSION}"}
CRDS = ("inferencepools", "inferenceobjectives", "inferencemodelrewrites")

_KEY = r"[A-Za-z0-9][A-Za-z0-9./_-]*"
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)$")
_EQ = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>[A-Za-z0-9._-]*)$")
_EXISTS = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_KEY})$")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """`a=b,c in (x,y),!d` → [(key, op, values)], ops: = != in notin exists !exists."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for raw in _split_selector(text):
        part = raw.strip()
        if m := _SET.match(part):
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            out.append((m["key"], m["op"], values))
        elif m := _EQ.match(part):
            out.append((m["key"], "!=" if m["op"] == "!=" else "=", (m["value"],)))
        elif m := _EXISTS.match(part):
            out.append((m["key"], "!exists" if m["neg"] else "exists", ()))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return out


def selector_matches(
    reqs: list[tuple[str, str, tuple[str, ...]]], labels: Mapping[str, str]
) -> bool:
    for key, op, values in reqs:
        present = key in labels
        value = labels.get(key)
        if op == "=" and value != values[0]:
            return False
        if op == "!=" and value == values[0]:
            return False
        if op == "in" and value not in values:
            return False
        if op == "notin" and present and value in values:
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
    return True


def status_object(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass(slots=True, eq=False)
class _Watch:
    resource: str
    matches: Any
    last_rv: int = 0
    queue: asyncio.Queue[JSON | None] = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class _Change:
    rv: int
    resource: str
    kind: str
    obj: JSON
    old: JSON | None


class FakeKubeApi:
    def __init__(
        self,
        namespace: str = "default",
        token: str | None = None,
        bookmark_interval_s: float = 0.5,
        gone_as: str = "event",
        crds: tuple[str, ...] = CRDS,
    ) -> None:
        """`gone_as`: how a watch from a compacted version fails — `event` (a 200
        stream whose only event is ERROR 410, as the API server answers) or `status`
        (HTTP 410 with a Status body). `crds`: the custom resources installed; the
        others answer 404 as on a cluster without their CRD."""
        self.namespace = namespace
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as = gone_as
        self.crds = set(crds)
        self.objects: dict[str, dict[str, JSON]] = {resource: {} for resource in KINDS}
        self.requests: list[tuple[str, dict[str, str]]] = []
        """(path, query) of every request, in order."""
        self.fail_next: list[int] = []
        """HTTP statuses to answer the next requests with (a Status body), first first."""
        self._rv = 100
        self._compacted = 0
        self._history: list[_Change] = []
        self._watches: set[_Watch] = set()
        self._paused = False
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- server ----------------------------------------------------------------------
    async def __aenter__(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/inferencepools", self._pools)
        for resource in ("inferenceobjectives", "inferencemodelrewrites"):
            app.router.add_get(
                f"/apis/{{group}}/{{version}}/namespaces/{{ns}}/{resource}", self._x_resource
            )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for watch in list(self._watches):
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str | None = None) -> Path:
        user: JSON = {"token": self.token} if self.token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {
                        "cluster": "fake",
                        "user": "fake",
                        "namespace": namespace or self.namespace,
                    },
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    def lists(self, resource: str = "pods") -> int:
        return sum(1 for p, q in self.requests if p.endswith(resource) and "watch" not in q)

    def watches(self, resource: str = "pods") -> int:
        return sum(1 for p, q in self.requests if p.endswith(resource) and "watch" in q)

    # -- objects ---------------------------------------------------------------------
    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _commit(self, resource: str, kind: str, obj: JSON, old: JSON | None) -> None:
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects[resource].pop(name, None)
        else:
            self.objects[resource][name] = obj
        change = _Change(rv, resource, kind, copy.deepcopy(obj), copy.deepcopy(old))
        self._history.append(change)
        if not self._paused:
            for watch in self._watches:
                event = self._filtered(watch, change)
                if event is not None:
                    watch.queue.put_nowait(event)

    def add_pod(
        self,
        name: str,
        ip: str,
        labels: Mapping[str, str],
        ready: bool = False,
        annotations: Mapping[str, str] | None = None,
        ports: tuple[int, ...] = (),
    ) -> JSON:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod: JSON = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": str(uuid.uuid4()),
                "labels": dict(labels),
                "annotations": dict(annotations or {}),
                "creationTimestamp": now,
            },
            "spec": {
                "containers": [
                    {
                        "name": "server",
                        "image": "vllm/vllm-openai:latest",
                        "ports": [{"containerPort": p, "protocol": "TCP"} for p in ports],
                    }
                ],
            },
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [],
            },
        }
        self._set_ready(pod, ready)
        self._commit("pods", "ADDED", pod, None)
        return pod

    @staticmethod
    def _set_ready(pod: JSON, ready: bool) -> None:
        status = "True" if ready else "False"
        pod["status"]["conditions"] = [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": status},
            {"type": "ContainersReady", "status": status},
            {"type": "PodScheduled", "status": "True"},
        ]

    def _modify(self, resource: str, name: str, change: Any) -> JSON:
        old = self.objects[resource][name]
        new = copy.deepcopy(old)
        change(new)
        self._commit(resource, "MODIFIED", new, old)
        return new

    def set_ready(self, name: str, ready: bool) -> JSON:
        return self._modify("pods", name, lambda pod: self._set_ready(pod, ready))

    def set_labels(self, name: str, labels: Mapping[str, str]) -> JSON:
        def change(pod: JSON) -> None:
            pod["metadata"]["labels"] = dict(labels)

        return self._modify("pods", name, change)

    def set_annotations(self, name: str, annotations: Mapping[str, str]) -> JSON:
        def change(pod: JSON) -> None:
            pod["metadata"]["annotations"] = dict(annotations)

        return self._modify("pods", name, change)

    def terminate_pod(self, name: str) -> JSON:
        """What `kubectl delete` shows first: a deletionTimestamp, then DELETED."""

        def change(pod: JSON) -> None:
            pod["metadata"]["deletionTimestamp"] = time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime()
            )

        return self._modify("pods", name, change)

    def delete_pod(self, name: str) -> None:
        old = self.objects["pods"][name]
        self._commit("pods", "DELETED", copy.deepcopy(old), old)

    def set_inference_pool(
        self,
        name: str,
        match_labels: Mapping[str, str],
        ports: tuple[int, ...],
        api_version: str = f"{POOL_GROUP}/{POOL_VERSION}",
    ) -> JSON:
        old = self.objects["inferencepools"].get(name)
        obj: JSON = (
            copy.deepcopy(old)
            if old
            else {
                "apiVersion": api_version,
                "kind": "InferencePool",
                "metadata": {"name": name, "namespace": self.namespace, "uid": str(uuid.uuid4())},
            }
        )
        obj["spec"] = {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {
                "name": "servegate",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        }
        self._commit("inferencepools", "MODIFIED" if old else "ADDED", obj, old)
        return obj

    def delete_inference_pool(self, name: str) -> None:
        old = self.objects["inferencepools"][name]
        self._commit("inferencepools", "DELETED", copy.deepcopy(old), old)

    def _set_x(self, resource: str, name: str, spec: JSON) -> JSON:
        """Create or replace the spec of an x-k8s.io object, as `kubectl apply` does:
        a spec change bumps `metadata.generation`; `creationTimestamp` stays."""
        old = self.objects[resource].get(name)
        if old is not None:
            obj = copy.deepcopy(old)
            if obj["spec"] != spec:
                obj["metadata"]["generation"] += 1
        else:
            obj = {
                "apiVersion": f"{X_GROUP}/{X_VERSION}",
                "kind": KINDS[resource][0],
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "uid": str(uuid.uuid4()),
                    "generation": 1,
                    "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                "status": {
                    "conditions": [
                        {
                            "type": "Accepted",
                            "status": "Unknown",
                            "reason": "Pending",
                            "message": "Waiting for controller",
                            "lastTransitionTime": "1970-01-01T00:00:00Z",
                        }
                    ]
                },
            }
        obj["spec"] = copy.deepcopy(spec)
        self._commit(resource, "MODIFIED" if old else "ADDED", obj, old)
        return obj

    @staticmethod
    def pool_ref(pool: str) -> JSON:
        """A `poolRef` as the API server stores it (the CRD's defaults filled in)."""
        return {"group": POOL_GROUP, "kind": "InferencePool", "name": pool}

    def set_objective(self, name: str, priority: int | None, pool: str) -> JSON:
        """An InferenceObjective; `priority` None leaves the field out (treated as 0)."""
        spec: JSON = {"poolRef": self.pool_ref(pool)}
        if priority is not None:
            spec["priority"] = priority
        return self._set_x("inferenceobjectives", name, spec)

    def delete_objective(self, name: str) -> None:
        old = self.objects["inferenceobjectives"][name]
        self._commit("inferenceobjectives", "DELETED", copy.deepcopy(old), old)

    def set_model_rewrite(
        self, name: str, pool: str, model: str | None, targets: Mapping[str, int | None]
    ) -> JSON:
        """An InferenceModelRewrite with one rule: `model` (None = every model nothing
        else serves) to `targets` (modelRewrite → weight, None = no weight)."""
        rule: JSON = {
            "targets": [
                {"modelRewrite": target, **({"weight": weight} if weight is not None else {})}
                for target, weight in targets.items()
            ]
        }
        if model is not None:
            rule["matches"] = [{"model": {"type": "Exact", "value": model}}]
        return self._set_x(
            "inferencemodelrewrites", name, {"poolRef": self.pool_ref(pool), "rules": [rule]}
        )

    def delete_model_rewrite(self, name: str) -> None:
        old = self.objects["inferencemodelrewrites"][name]
        self._commit("inferencemodelrewrites", "DELETED", copy.deepcopy(old), old)

    # -- watch control -----------------------------------------------------------------
    def pause(self) -> None:
        """Stop delivering changes to open watches (a slow or partitioned watch)."""
        self._paused = True

    def expire(self) -> None:
        """Compact history to now: open watches get ERROR 410 and end; re-watching
        from any version seen so far answers 410, so clients must list again.
        Changes not yet delivered (made while paused) are never delivered."""
        self._compacted = self._next_rv()
        self._history.clear()
        self._paused = False
        for watch in list(self._watches):
            while not watch.queue.empty():
                watch.queue.get_nowait()
            watch.queue.put_nowait(self._gone_event())
            watch.queue.put_nowait(None)

    def close_watches(self) -> None:
        """End every open watch cleanly, as the server does at `timeoutSeconds`."""
        for watch in list(self._watches):
            watch.queue.put_nowait(None)

    def _gone_event(self) -> JSON:
        return {
            "type": "ERROR",
            "object": status_object(
                410, "Expired", "too old resource version: watch history was compacted"
            ),
        }

    def _filtered(self, watch: _Watch, change: _Change) -> JSON | None:
        if change.resource != watch.resource:
            return None
        new_ok = change.kind != "DELETED" and watch.matches(change.obj)
        old_ok = change.old is not None and watch.matches(change.old)
        if change.kind == "DELETED":
            return {"type": "DELETED", "object": change.obj} if old_ok else None
        if new_ok and old_ok:
            return {"type": change.kind, "object": change.obj}
        if new_ok:
            return {"type": "ADDED", "object": change.obj}
        if old_ok:
            gone = copy.deepcopy(change.old)
            assert gone is not None
            gone["metadata"]["resourceVersion"] = change.obj["metadata"]["resourceVersion"]
            return {"type": "DELETED", "object": gone}
        return None

    # -- handlers ------------------------------------------------------------------------
    def _matcher(self, request: web.Request) -> Any:
        labels = parse_label_selector(request.query.get("labelSelector", ""))
        fields = request.query.get("fieldSelector", "")
        name = fields.partition("metadata.name=")[2] if fields else ""

        def matches(obj: JSON) -> bool:
            meta = obj["metadata"]
            if name and meta["name"] != name:
                return False
            return selector_matches(labels, meta.get("labels") or {})

        return matches

    def _check(self, request: web.Request) -> web.Response | None:
        self.requests.append((request.path, dict(request.query)))
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return self._status(401, "Unauthorized", "Unauthorized")
        if request.match_info["ns"] != self.namespace:
            return self._status(403, "Forbidden", "namespace not served by this fake")
        if self.fail_next:
            code = self.fail_next.pop(0)
            return self._status(code, "InternalError", f"injected failure {code}")
        return None

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.Response(
            status=code,
            body=orjson.dumps(status_object(code, reason, message)),
            content_type="application/json",
        )

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "pods", "PodList", "v1")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        if "inferencepools" not in self.crds:
            return self._not_found(request)
        api_version = f"{request.match_info['group']}/{request.match_info['version']}"
        return await self._serve(request, "inferencepools", "InferencePoolList", api_version)

    async def _x_resource(self, request: web.Request) -> web.StreamResponse:
        resource = request.path.rsplit("/", 1)[1]
        group, version = request.match_info["group"], request.match_info["version"]
        if resource not in self.crds or (group, version) != (X_GROUP, X_VERSION):
            return self._not_found(request)
        return await self._serve(request, resource, KINDS[resource][1], f"{X_GROUP}/{X_VERSION}")

    def _not_found(self, request: web.Request) -> web.Response:
        """What the API server answers for a resource no installed CRD defines."""
        self.requests.append((request.path, dict(request.query)))
        return self._status(404, "NotFound", "the server could not find the requested resource")

    async def _serve(
        self, request: web.Request, resource: str, list_kind: str, api_version: str
    ) -> web.StreamResponse:
        failed = self._check(request)
        if failed is not None:
            return failed
        try:
            matches = self._matcher(request)
        except ValueError as exc:
            return self._status(400, "BadRequest", str(exc))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, resource, matches)
        items = [copy.deepcopy(o) for _, o in sorted(self.objects[resource].items()) if matches(o)]
        body = {
            "kind": list_kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(self, request: web.Request, resource: str, matches: Any) -> web.StreamResponse:
        raw_rv = request.query.get("resourceVersion", "")
        try:
            since = int(raw_rv) if raw_rv else 0
        except ValueError:
            return self._status(400, "BadRequest", f"invalid resourceVersion {raw_rv!r}")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        if since and since < self._compacted and self.gone_as == "status":
            return self._status(410, "Expired", "too old resource version")
        watch = _Watch(resource, matches, last_rv=since or self._rv)
        if since and since < self._compacted:
            watch.queue.put_nowait(self._gone_event())
            watch.queue.put_nowait(None)
        elif since:
            for change in self._history:
                if change.rv > since:
                    event = self._filtered(watch, change)
                    if event is not None:
                        watch.queue.put_nowait(event)
        else:
            for _, obj in sorted(self.objects[resource].items()):
                if matches(obj):
                    watch.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        self._watches.add(watch)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait = min(left, self.bookmark_interval_s) if bookmarks else left
                try:
                    event = await asyncio.wait_for(watch.queue.get(), wait)
                except TimeoutError:
                    if not bookmarks or time.monotonic() >= deadline:
                        continue
                    if not self._paused:
                        watch.last_rv = self._rv
                    event = {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": KINDS[resource][0],
                            "apiVersion": API_VERSIONS.get(resource, f"{X_GROUP}/{X_VERSION}"),
                            "metadata": {"resourceVersion": str(watch.last_rv)},
                        },
                    }
                if event is None:
                    break
                rv = event["object"].get("metadata", {}).get("resourceVersion")
                if isinstance(rv, str) and rv.isdigit():
                    watch.last_rv = max(watch.last_rv, int(rv))
                await response.write(orjson.dumps(event) + b"\n")
        except ConnectionResetError:
            pass
        finally:
            self._watches.discard(watch)
        return response
