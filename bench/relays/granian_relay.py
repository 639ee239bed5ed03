"""The bare relay on granian's Rust HTTP server through RSGI (a benchmark subject).

Parses the body once (orjson), picks the next upstream round-robin, relays the
answer whole or chunk by chunk. Upstreams and client come from the environment,
as granian owns the command line:

    RELAY_UPSTREAMS=http://127.0.0.1:8101,http://127.0.0.1:8102 RELAY_CLIENT=lean \\
        granian --interface rsgi --loop uvloop --workers 1 --runtime-threads 1 \\
        --no-ws --no-log --working-dir bench/relays --port 9000 granian_relay:app

RELAY_CLIENT: `aiohttp` (pooled ClientSession, the default) or `lean` (lean.LeanPool).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from typing import Any

import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lean import LeanPool

JSON_HEADERS = [("content-type", "application/json")]
SSE_HEADERS = [("content-type", "text/event-stream")]


class Relay:
    def __init__(self) -> None:
        self.upstreams = [u for u in os.environ.get("RELAY_UPSTREAMS", "").split(",") if u]
        self.client = os.environ.get("RELAY_CLIENT", "aiohttp")
        self.order = itertools.cycle(self.upstreams)
        self.session: Any = None
        self.pool: LeanPool | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.client == "lean":
            self.pool = LeanPool(self.upstreams)

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        body = await protocol()
        payload = orjson.loads(body)
        stream = isinstance(payload, dict) and bool(payload.get("stream"))
        upstream = next(self.order)
        if self.pool is not None:
            answer = await self.pool.request(upstream, scope.path.encode(), body)
            if not stream:
                protocol.response_bytes(answer.status, JSON_HEADERS, await answer.read())
                return
            transport = protocol.response_stream(answer.status, SSE_HEADERS)
            async for chunk in answer.chunks():
                await transport.send_bytes(chunk)
            return
        if self.session is None:
            from aiohttp import ClientSession, TCPConnector

            self.session = ClientSession(connector=TCPConnector(limit=0))
        async with self.session.post(
            upstream + scope.path, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if not stream:
                protocol.response_bytes(resp.status, JSON_HEADERS, await resp.read())
                return
            transport = protocol.response_stream(resp.status, SSE_HEADERS)
            async for chunk in resp.content.iter_any():
                await transport.send_bytes(chunk)


app = Relay()
