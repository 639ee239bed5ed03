"""The running gateway: what exists only while the gateway serves, built complete at start.

`build_gateway` (app.py) makes the `Gateway`: the Director and its `RoutingSnapshot`,
metrics, the upstream transport; nothing in it runs. `start_gateway` opens and starts
what a serving gateway needs, in this order, and returns them as one `RunningGateway`:

1. the upstream transport, and the control session (scrapes' and health probes' own
   connection pool: aiohttp reuses idle connections first-in first-out, so probes
   cycling through the request path's pool would keep every idle connection alive, and
   a saturated request pool must not delay a probe);
2. the probe server (`NoProbes` when `gateway.probe_port` is not set);
3. scale-out (None when the process runs alone), before any pool: a follower worker's
   pools must not scrape;
4. every pool's feed (data layer, discovery) and its runtimes' routing tokenizers;
5. the cluster's objectives and rewrites.

`stop()` undoes them in reverse. The HTTP app (app.py) and the ext_proc server both
start the gateway this way; the reloader (reload.py) starts and stops runtimes through
`start_runtimes` and `stop_runtimes`, and calls `reloaded()` once it switched over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from servegate.gateway.cluster_policy import apply_cluster_policy
from servegate.gateway.feeds import PoolFeeds
from servegate.gateway.pools import PoolRuntime
from servegate.gateway.probes import NoProbes, ProbeServer
from servegate.scaleout.wiring import ScaleOut, start_scaleout

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway

log = logging.getLogger("servegate.gateway")


@dataclass(frozen=True, slots=True, eq=False)
class RunningGateway:
    gateway: Gateway
    control: aiohttp.ClientSession
    """Scrapes' and health probes' own connection pool; open while the gateway runs."""
    feeds: PoolFeeds
    """Every running pool's data layer and discovery."""
    probes: ProbeServer | NoProbes
    scaleout: ScaleOut | None
    """Shared routing state with other workers and replicas; None when this process runs
    alone (no supervisor, no `scaleout.bind`)."""

    @property
    def session(self) -> aiohttp.ClientSession:
        """What routing tokenizers download with: the request path's session when the
        transport has one, else the control session."""
        return self.gateway.transport.session or self.control

    async def start_runtimes(self, runtimes: tuple[PoolRuntime, ...]) -> None:
        """Start each runtime's pool feed (once per pool state) and its routing tokenizers."""
        for runtime in runtimes:
            await self.feeds.start(runtime.state)
            await runtime.start(self.session)

    async def stop_runtimes(
        self, stopping: tuple[PoolRuntime, ...], keeping: tuple[PoolRuntime, ...]
    ) -> None:
        """Stop `stopping`, and the feeds of their pools that no runtime in `keeping` uses."""
        kept = {id(r.state) for r in keeping}
        for runtime in stopping:
            await runtime.stop()
            if id(runtime.state) not in kept:
                await self.feeds.stop(runtime.state)

    def reloaded(self) -> None:
        """After a reload switched the gateway over: fold the cluster's policy into the new
        admission and routing table, and hook scale-out to the new schedulers and pools."""
        gw = self.gateway
        try:
            apply_cluster_policy(gw, self.feeds)
        except Exception:
            log.exception("applying the cluster's policy after a reload failed")
        if self.scaleout is not None:
            try:
                self.scaleout.reattach(gw)
            except Exception:
                log.exception("reattaching scale-out after a reload failed")

    async def stop(self) -> None:
        gw = self.gateway
        self.probes.stop()
        if self.scaleout is not None:
            await self.scaleout.stop()
        for runtime in gw.runtimes:
            await runtime.stop()
        await self.feeds.close()
        await self.control.close()
        await gw.transport.close()


async def start_gateway(
    gw: Gateway, *, probe_port: int | None = None, scale_out: bool = True
) -> RunningGateway:
    """Open and start everything `gw` needs to serve (the module docstring's order).
    `probe_port`: serve /health and /ready from a thread of their own on it;
    `scale_out`: join other workers and replicas when the environment or config says so."""
    gw.transport.open()
    control = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
    )
    feeds = PoolFeeds(control)
    probes: ProbeServer | NoProbes = NoProbes()
    scaleout = None
    try:
        if probe_port is not None:
            probes = ProbeServer(gw.pool, gw.config.gateway.host, probe_port)
            probes.start()
        if scale_out:
            scaleout = await start_scaleout(gw, feeds.set_scraping)
    except BaseException:
        probes.stop()
        await control.close()
        await gw.transport.close()
        raise
    running = RunningGateway(gw, control, feeds, probes, scaleout)
    try:
        await running.start_runtimes(gw.runtimes)
    except BaseException:
        await running.stop()
        raise
    apply_cluster_policy(gw, feeds)  # and again whenever the cluster's objects change
    log.info(
        "gateway started",
        extra={"fields": {"pools": {r.name: [s.address for s in r.pool] for r in gw.runtimes}}},
    )
    return running


RUNNING = web.AppKey("running", RunningGateway)
"""The HTTP app's running gateway, set when the app starts."""
