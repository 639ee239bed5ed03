"""Discovery: what puts endpoints into the pool and takes them out.

`static` is the config file's `pool.endpoints`, added once by the gateway at
startup. `kubernetes` follows pods (or an InferencePool) while the gateway runs;
`ray` follows the model-server replicas of a Ray Serve application.
"""

from __future__ import annotations

from typing import Protocol

from servegate.pool.discovery.settings import (
    DiscoverySettings,
    KubernetesDiscoverySettings,
    LabelSelector,
    RayDiscoverySettings,
    StaticDiscoverySettings,
)
from servegate.pool.pool import Pool

__all__ = [
    "Discovery",
    "DiscoverySettings",
    "FixedMembership",
    "KubernetesDiscoverySettings",
    "LabelSelector",
    "RayDiscoverySettings",
    "StaticDiscoverySettings",
    "start_discovery",
]


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class FixedMembership:
    """Static discovery: the config's endpoints, added when the pool was built; nothing to
    follow while the gateway runs."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def start_discovery(settings: DiscoverySettings, pool: Pool) -> Discovery:
    """The running discovery for `settings` (`FixedMembership` for static).

    Raises `ConfigError` when Kubernetes credentials cannot be loaded: a gateway
    told to watch a cluster it cannot reach must not start as if it had no pods.
    An API server that is down or refuses is retried with backoff instead.
    """
    if isinstance(settings, RayDiscoverySettings):
        from servegate.pool.discovery.ray import RayDiscovery, ServeRegistrySource

        ray_discovery = RayDiscovery(settings, pool, ServeRegistrySource(settings))
        await ray_discovery.start()
        return ray_discovery
    if not isinstance(settings, KubernetesDiscoverySettings):
        return FixedMembership()
    from servegate.config import ConfigError
    from servegate.pool.discovery.kubeapi import KubeApiError, connect
    from servegate.pool.discovery.kubernetes import KubernetesDiscovery

    try:
        connection = await connect(
            settings.kubeconfig,
            settings.context,
            settings.namespace,
            request_timeout_s=settings.request_timeout_s,
            watch_timeout_s=settings.watch_timeout_s,
        )
    except KubeApiError as exc:
        raise ConfigError(f"pool.discovery: {exc}") from exc
    discovery = KubernetesDiscovery(settings, pool, connection.api, connection.namespace)
    await discovery.start()
    return discovery
