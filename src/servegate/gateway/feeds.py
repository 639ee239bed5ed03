"""What keeps each pool's state fresh while the gateway runs: its data layer and discovery
(and the session Triton models' tokenizers are learned over).

A pool's feed exists only while the gateway runs, so it is not part of the pool's
state (built with the gateway, before any session is open): `PoolFeeds` builds
each one complete, on the control session, when a runtime over that pool first
starts, and stops it when no runtime uses the pool any more. Runtimes that share
a pool state (a picker reload) share its feed.

A scale-out follower worker turns scraping off (`set_scraping(False)`) before any
pool starts: its data layers are built but idle until the leader falls silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from servegate.datalayer import DataLayer
from servegate.gateway.pools import PoolState
from servegate.pool.discovery import Discovery, start_discovery


@dataclass(frozen=True, slots=True, eq=False)
class PoolFeed:
    datalayer: DataLayer
    """Scrapes and health checks for every endpoint in the pool."""
    discovery: Discovery
    """What adds and removes the pool's endpoints (`FixedMembership` for static ones)."""

    async def stop(self) -> None:
        await self.discovery.stop()
        await self.datalayer.stop()


def build_datalayer(state: PoolState, control: aiohttp.ClientSession) -> DataLayer:
    """`state`'s data layer over `control` (scrapes' and probes' own session), not started."""
    settings = state.settings
    return DataLayer(state.pool, control, state.engines, scrape=settings, health=settings.health)


class PoolFeeds:
    """Each running pool's feed, by pool state; the one owner of the control session's users."""

    def __init__(self, control: aiohttp.ClientSession) -> None:
        self.control = control
        self.scraping = True
        """False on a scale-out follower while its leader scrapes for it."""
        self._feeds: dict[PoolState, PoolFeed] = {}

    def __getitem__(self, state: PoolState) -> PoolFeed:
        return self._feeds[state]

    def __contains__(self, state: object) -> bool:
        return state in self._feeds

    async def start(self, state: PoolState) -> PoolFeed:
        """`state`'s feed, started now unless it runs already. Raises (with nothing left
        running) when its discovery cannot start."""
        feed = self._feeds.get(state)
        if feed is not None:
            return feed
        datalayer = build_datalayer(state, self.control)
        if self.scraping:
            await datalayer.start()
        try:
            discovery = await start_discovery(state.settings.discovery, state.pool)
        except BaseException:
            await datalayer.stop()
            raise
        feed = self._feeds[state] = PoolFeed(datalayer, discovery)
        state.triton_tokens.bind_session(self.control)
        return feed

    async def stop(self, state: PoolState) -> None:
        feed = self._feeds.pop(state, None)
        if feed is not None:
            await state.triton_tokens.close()
            state.triton_tokens.bind_session(None)
            await feed.stop()

    async def close(self) -> None:
        for state in list(self._feeds):
            await self.stop(state)

    async def set_scraping(self, on: bool) -> None:
        """Start or stop every pool's scrapes and health checks (a follower takes over from
        a silent leader, and hands back when it is heard again)."""
        self.scraping = on
        for feed in list(self._feeds.values()):
            await (feed.datalayer.start() if on else feed.datalayer.stop())
