"""The request path's upstream client as `gateway.upstream_client` names it (a module of
its own: `lean_transport` builds on `transport`, so neither may import the other back)."""

from __future__ import annotations

from servegate.gateway.lean_transport import LeanTransport
from servegate.gateway.transport import AiohttpTransport, UpstreamTransport


def transport_for(client: str) -> UpstreamTransport:
    if client == "lean":
        return LeanTransport()
    if client == "aiohttp":
        return AiohttpTransport()
    raise ValueError(f"unknown upstream client {client!r}")
