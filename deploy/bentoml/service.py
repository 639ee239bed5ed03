"""servegate's gateway as a BentoML service (docs/backends.md, "BentoML").

BentoML serves ASGI, so the service mounts `GatewayASGI` at `/`: the gateway's
request path runs directly in the service's process and event loop (no loopback
hop, no socket of its own; streaming, retries, errors and metrics are the
gateway's own). BentoML's own routes (`/healthz`, `/livez`, `/readyz`, `/metrics`)
stay BentoML's; the gateway answers `/v1/*`, `/health`, `/ready` and `/admin/*`.

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
