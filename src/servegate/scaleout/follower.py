"""A follower worker's data layer: built like any other, started only on takeover.

The pool runtimes start their data layer unconditionally; a follower swaps in a
`FollowerDataLayer` before they start, so its `start()` does nothing until the
leader falls silent (`activate`) and stops again when the leader is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from servegate.datalayer import DataLayer
from servegate.gateway.pools import build_pool_datalayer

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway


class FollowerDataLayer(DataLayer):
    def __init__(self, template: DataLayer) -> None:
        super().__init__(
            template.pool,
            template.session,
            template.engines,
            template.scrape_settings,
            template.health_settings,
            scrape_enabled=template.scrape_enabled,
            health_enabled=template.health_enabled,
        )
        self.active = False

    async def start(self) -> None:
        if self.active:
            await super().start()

    async def activate(self) -> None:
        self.active = True
        await super().start()

    async def deactivate(self) -> None:
        self.active = False
        await super().stop()


def install_followers(gw: Gateway) -> list[asyncio.Task[None]]:
    """Give every pool a follower data layer; a running one (after a reload) is stopped."""
    stopping = []
    assert gw.control is not None
    for runtime in gw.pool_runtimes():
        state = runtime.state
        current = state.datalayer
        if isinstance(current, FollowerDataLayer):
            continue
        if current is not None:
            stopping.append(asyncio.get_running_loop().create_task(current.stop()))
            template = current
        else:
            template = build_pool_datalayer(state.settings, state.pool, gw.control, state.engines)
        state.datalayer = FollowerDataLayer(template)
    return stopping


def followers(gw: Gateway) -> Iterable[FollowerDataLayer]:
    for runtime in gw.pool_runtimes():
        if isinstance(runtime.state.datalayer, FollowerDataLayer):
            yield runtime.state.datalayer
