"""Applying the cluster's InferenceObjectives and InferenceModelRewrites to the gateway.

Each pool with Kubernetes discovery keeps a `ClusterPolicy` (pool/discovery/policy.py).
Whenever one changes, and after every config reload (which rebuilds admission and the
routing table from the file), `apply_cluster_policy` recomputes:

- each such pool's objective priorities: the config's `flow_control.objectives`, with
  the cluster's objectives of the same name winning;
- the routing table: the config's `model_rewrites`, then every cluster rewrite (oldest
  first) less the models something before it matches already.

Both are swapped in by one assignment each, so a request sees the old set or the new.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from servegate.gateway.model_routing import RoutingTable
from servegate.pool.discovery.policy import ClusterPolicy, merge_rewrites
from servegate.rewrites import ModelRewrite

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway
    from servegate.gateway.feeds import PoolFeeds
    from servegate.pool.discovery import Discovery

log = logging.getLogger("servegate.gateway")


def policy_of(discovery: Discovery) -> ClusterPolicy | None:
    from servegate.pool.discovery.kubernetes import KubernetesDiscovery

    return discovery.policy if isinstance(discovery, KubernetesDiscovery) else None


def apply_cluster_policy(gw: Gateway, feeds: PoolFeeds) -> None:
    """Fold the cluster's objectives and rewrites into `gw`; a no-op without any.
    `feeds`: the running pools' discovery, which holds each pool's `ClusterPolicy`."""
    cluster: list[ModelRewrite] = []
    found = False
    for runtime in gw.runtimes:
        policy = policy_of(feeds[runtime.state].discovery)
        if policy is None:
            continue
        found = True
        policy.listen(gw, lambda: apply_cluster_policy(gw, feeds))
        base = (runtime.entry.flow_control or gw.config.flow_control).priorities()
        for name in sorted(base.keys() & policy.objectives.keys()):
            if base[name] != policy.objectives[name]:
                log.info(
                    "InferenceObjective %s overrides the config's priority %d with %d",
                    name,
                    base[name],
                    policy.objectives[name],
                )
        runtime.admission.priorities = {**base, **policy.objectives}
        cluster.extend(policy.rewrites)
    if not found:
        return
    merged, dropped = merge_rewrites(gw.config.model_rewrites, cluster)
    for why in dropped:
        log.warning("InferenceModelRewrite %s; the earlier match stays", why)
    gw.swap(dataclasses.replace(gw.snapshot, routing=RoutingTable.from_config(merged)))
