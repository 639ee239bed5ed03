"""Run a gateway inside the current event loop on a free loopback port."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from aiohttp import web

from servegate.config import ServegateConfig, parse_config
from servegate.gateway.app import GATEWAY, Gateway, build_gateway, create_app
from servegate.gateway.connections import CONNECTIONS, GuardedSite
from servegate.gateway.lifecycle import RUNNING, RunningGateway
from servegate.gateway.reload import RELOADER, ConfigSource, Reloader
from servegate.gateway.server import server_options


class GatewayRunner:
    """`async with GatewayRunner(cfg) as gw:` — `gw.url`, `gw.gateway`, `gw.running`,
    `gw.reloader` (re-reads `source`), `gw.access_lines()`."""

    def __init__(
        self,
        config: ServegateConfig | dict[str, Any],
        config_dir: Path | None = None,
        host: str = "127.0.0.1",
        source: ConfigSource | None = None,
    ) -> None:
        if isinstance(config, dict):
            config = parse_config("", "<test>", environ={}, overrides=config)
        self.config = config
        self._config_dir = config_dir
        self.host = host
        self.source = source
        self._access = io.BytesIO()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> GatewayRunner:
        gw = build_gateway(self.config, self._config_dir, self._access)
        self.app = create_app(gw, self.source)
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            **server_options(self.config.gateway),
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner, self.app[CONNECTIONS], host=self.host, port=self.config.gateway.port
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]

    @property
    def running(self) -> RunningGateway:
        return self.app[RUNNING]

    @property
    def reloader(self) -> Reloader:
        return self.app[RELOADER]

    @property
    def access_stream(self) -> io.BytesIO:
        """The access log so far: what the gateway still buffers is written out first."""
        if hasattr(self, "app"):
            self.gateway.access_log.flush()
        return self._access

    def access_lines(self) -> list[dict[str, Any]]:
        import orjson

        return [orjson.loads(line) for line in self.access_stream.getvalue().splitlines() if line]
