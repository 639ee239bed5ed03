"""What one request routes by, frozen: the config, every pool's runtime, the routing table.

A reload builds a new snapshot whole and swaps the one reference the `Director` holds; a
request reads that reference once at its start and keeps its snapshot across every await,
so it never sees half of one configuration and half of the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servegate.config import ServegateConfig
    from servegate.gateway.model_routing import RoutingTable
    from servegate.gateway.pools import PoolRuntime
    from servegate.gateway.tenants import TenantTable


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    config: ServegateConfig
    runtimes: tuple[PoolRuntime, ...]
    """Every pool's runtime; the first is the default pool's."""
    routing: RoutingTable
    tenants: TenantTable
    """Accepted keys and their tenants."""

    @property
    def default(self) -> PoolRuntime:
        return self.runtimes[0]

    def runtime(self, name: str) -> PoolRuntime | None:
        return next((r for r in self.runtimes if r.name == name), None)
