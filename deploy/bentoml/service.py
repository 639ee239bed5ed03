"""servegate's gateway as a BentoML service (docs/backends.md, "BentoML").

The gateway is an aiohttp application and BentoML serves ASGI, so the service
mounts `GatewayASGI` at `/`: it runs the real gateway in the service's process
and event loop on a loopback port and relays each request to it (one loopback
hop; streaming, errors and metrics are the gateway's own). BentoML's own routes
(`/healthz`, `/livez`, `/readyz`, `/metrics`) stay BentoML's; the gateway's
`/v1/*`, `/health`, `/ready` and `/admin/*` pass through.

The gateway's config is `gateway.yaml` next to this file, or the file named by
`SERVEGATE_CONFIG`; `SERVEGATE_*__*` variables override single fields.
"""

from __future__ import annotations

import os
from pathlib import Path

import bentoml

from servegate.integrations.asgi_gateway import GatewayASGI

CONFIG = Path(os.environ.get("SERVEGATE_CONFIG") or Path(__file__).with_name("gateway.yaml"))

gateway = GatewayASGI.from_file(CONFIG)


@bentoml.asgi_app(gateway, path="/")
@bentoml.service(name="servegate", traffic={"timeout": 1800})
class Servegate:
    @bentoml.on_startup
    async def start_gateway(self) -> None:
        await gateway.start()

    @bentoml.on_shutdown
    async def stop_gateway(self) -> None:
        await gateway.stop()
