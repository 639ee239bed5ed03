"""InferenceObjectives and InferenceModelRewrites from the cluster, for one pool.

The Gateway API Inference Extension keeps request priorities (InferenceObjective,
`spec.priority`) and model aliases and weighted splits (InferenceModelRewrite,
`spec.rules`) as namespaced objects that name their InferencePool in `spec.poolRef`.
`ClusterPolicy` is the store two reflectors (kubernetes.py) fill: the objects whose
poolRef names this pool, parsed into what the config's `flow_control.objectives` and
`model_rewrites` hold, rebuilt on every change. Listeners (the gateway) are told
when the result changes; an object that does not parse is left out, logged and kept
in `rejected`, and never stops the others.

Precedence, as the API defines it: between rewrites, an exact model match beats a
rule with no `matches`, and of two rewrites matching the same model the older one
(`metadata.creationTimestamp`, then name) wins. `merge_rewrites` puts the config's
own rewrites ahead of every cluster object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from servegate.rewrites import ModelRewrite, RewriteRule

log = logging.getLogger("servegate.discovery")

POOL_GROUPS = ("", "inference.networking.k8s.io", "inference.networking.x-k8s.io")
Listener = Callable[[], None]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _name(obj: Mapping[str, Any]) -> str | None:
    name = _mapping(obj.get("metadata")).get("name")
    return name if isinstance(name, str) and name else None


def _age_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    created = _mapping(obj.get("metadata")).get("creationTimestamp")
    return (created if isinstance(created, str) else "", _name(obj) or "")


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "spec"
        return f"{where}: {error['msg']}"
    return str(exc)


class ClusterPolicy:
    """The objectives and model rewrites of one pool, as the cluster holds them now."""

    def __init__(self, pool_ref: str, pool_name: str) -> None:
        """`pool_ref`: the InferencePool name objects must reference; `pool_name`: the
        servegate pool their rewrites route to."""
        self.pool_ref = pool_ref
        self.pool_name = pool_name
        self._objects: dict[str, dict[str, Mapping[str, Any]]] = {
            "InferenceObjective": {},
            "InferenceModelRewrite": {},
        }
        self.objectives: dict[str, int] = {}
        """Objective name → priority (unset = 0)."""
        self.rewrites: tuple[ModelRewrite, ...] = ()
        """Oldest first; each routes to `pool_name`."""
        self.rejected: dict[str, str] = {}
        """`Kind/name` → why it was left out."""
        self.changes = 0
        self._listeners: dict[int, Listener] = {}

    # -- listeners -----------------------------------------------------------------
    def listen(self, key: object, listener: Listener) -> None:
        """Call `listener()` after each change; one listener per `key` (a re-listen replaces)."""
        self._listeners[id(key)] = listener

    def _notify(self) -> None:
        for listener in list(self._listeners.values()):
            try:
                listener()
            except Exception:
                log.exception("a cluster-policy listener failed")

    # -- reflector callbacks -----------------------------------------------------------
    def replacer(self, kind: str) -> Callable[[Sequence[Mapping[str, Any]]], None]:
        def replace(items: Sequence[Mapping[str, Any]]) -> None:
            store = self._objects[kind]
            store.clear()
            for obj in items:
                name = _name(obj)
                if name is not None:
                    store[name] = obj
            self._rebuild()

        return replace

    def applier(self, kind: str) -> Callable[[str, Mapping[str, Any]], None]:
        def apply(event: str, obj: Mapping[str, Any]) -> None:
            name = _name(obj)
            if name is None:
                return
            if event == "DELETED":
                self._objects[kind].pop(name, None)
            else:
                self._objects[kind][name] = obj
            self._rebuild()

        return apply

    # -- parsing ---------------------------------------------------------------------
    def _for_this_pool(self, spec: Mapping[str, Any]) -> bool:
        ref = _mapping(spec.get("poolRef"))
        group = ref.get("group", "")
        kind = ref.get("kind", "InferencePool")
        return ref.get("name") == self.pool_ref and group in POOL_GROUPS and kind == "InferencePool"

    @staticmethod
    def _priority(spec: Mapping[str, Any]) -> int:
        priority = spec.get("priority", 0)
        if priority is None:
            return 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"spec.priority: {priority!r} is not an integer")
        return priority

    def _rewrite(self, name: str, spec: Mapping[str, Any]) -> ModelRewrite:
        rewrite = ModelRewrite.model_validate(
            {"kind": "InferenceModelRewrite", "metadata": {"name": name}, "spec": dict(spec)}
        )
        return rewrite.model_copy(update={"pool_ref": self.pool_name})

    def _rebuild(self) -> None:
        objectives: dict[str, int] = {}
        rewrites: list[ModelRewrite] = []
        rejected: dict[str, str] = {}
        for kind, store in self._objects.items():
            for obj in sorted(store.values(), key=_age_key):
                name = _name(obj)
                spec = _mapping(obj.get("spec"))
                if name is None or not self._for_this_pool(spec):
                    continue
                try:
                    if kind == "InferenceObjective":
                        objectives[name] = self._priority(spec)
                    else:
                        rewrites.append(self._rewrite(name, spec))
                except (ValidationError, ValueError) as exc:
                    rejected[f"{kind}/{name}"] = _first_line(exc)
        for key in rejected.keys() - self.rejected.keys():
            log.warning("%s for pool %s is left out: %s", key, self.pool_ref, rejected[key])
        self.rejected = rejected
        if objectives == self.objectives and tuple(rewrites) == self.rewrites:
            return
        self.objectives = objectives
        self.rewrites = tuple(rewrites)
        self.changes += 1
        log.info(
            "cluster objectives and model rewrites changed",
            extra={
                "fields": {
                    "pool": self.pool_ref,
                    "objectives": objectives,
                    "model_rewrites": [r.name for r in rewrites],
                }
            },
        )
        self._notify()


def merge_rewrites(
    config: Sequence[ModelRewrite], cluster: Iterable[ModelRewrite]
) -> tuple[tuple[ModelRewrite, ...], list[str]]:
    """The config's rewrites, then each cluster rewrite's rules less the models already
    matched (and less a second catch-all rule); what was dropped, described."""
    seen: set[str] = set()
    catch_all = False
    for rewrite in config:
        for rule in rewrite.rules:
            catch_all |= not rule.matches
            seen.update(m.model for m in rule.matches)
    merged = list(config)
    dropped: list[str] = []
    for rewrite in cluster:
        rules: list[RewriteRule] = []
        for rule in rewrite.rules:
            if not rule.matches:
                if catch_all:
                    dropped.append(f"{rewrite.name}: a second rule for any model")
                    continue
                catch_all = True
                rules.append(rule)
                continue
            matches = tuple(m for m in rule.matches if m.model not in seen)
            for m in rule.matches:
                if m.model in seen:
                    dropped.append(f"{rewrite.name}: model {m.model!r} is already matched")
            seen.update(m.model for m in matches)
            if matches:
                rules.append(rule.model_copy(update={"matches": matches}))
        if rules:
            merged.append(rewrite.model_copy(update={"rules": tuple(rules)}))
    return tuple(merged), dropped
