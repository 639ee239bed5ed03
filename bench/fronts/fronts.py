"""servegate's request path behind other HTTP servers (benchmark subjects for
`bench/gateway_overhead.py`): GatewayASGI for granian's or uvicorn's ASGI interface, and a
thin RSGI adapter over `serve_inference` for granian's RSGI interface.

The replica URL comes from the environment, as the server owns the command line:

    FRONT_ENDPOINT=http://127.0.0.1:8101 granian --interface rsgi --loop uvloop \\
        --workers 1 --runtime-threads 1 --no-ws --log-level warning \\
        --working-dir bench/fronts --port 9000 --factory fronts:rsgi_app
    FRONT_ENDPOINT=... granian --interface asgi ... --factory fronts:asgi_app
    FRONT_ENDPOINT=... uvicorn --loop uvloop --http httptools --no-access-log \\
        --app-dir bench/fronts --factory fronts:asgi_app

`FRONT_WATCH` (`task`, `callback`, `0`) chooses how the RSGI adapter notices a client
that leaves (see `GatewayRSGI.watch`). The RSGI
adapter serves the inference routes only (enough to measure the request path);
the gateway starts in the worker's event loop before it serves (ASGI lifespan,
`__rsgi_init__`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

from multidict import CIMultiDict

from servegate.config import GatewaySettings, ServegateConfig, load_config
from servegate.control.errors import BodyTooLarge, NotFound, RequestTimeout
from servegate.control.sink import Headers, send_error
from servegate.gateway.inference import serve_inference
from servegate.integrations.asgi_gateway import INFERENCE_KINDS, GatewayASGI, until_done_or_gone


def _config() -> ServegateConfig:
    endpoint = os.environ["FRONT_ENDPOINT"]
    return load_config(None, overrides={"pool": {"endpoints": [{"url": endpoint}]}})


def asgi_app() -> GatewayASGI:
    return GatewayASGI(_config())


class RsgiSink:
    """The `ClientSink` of one RSGI request: `response_bytes` for a whole answer,
    `response_stream` and `send_bytes` for a streamed one."""

    __slots__ = ("_protocol", "_remote", "_stream", "aborted", "gone")

    def __init__(self, protocol: Any, remote: str | None) -> None:
        self._protocol = protocol
        self._remote = remote
        self._stream: Any = None
        self.aborted = False
        self.gone = False

    @property
    def started(self) -> bool:
        return self._stream is not None

    @property
    def remote(self) -> str | None:
        return self._remote

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._stream = True
        self._protocol.response_bytes(
            status, [(k, v) for k, v in headers if k.lower() != "content-length"], body
        )

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        out = [(k, v) for k, v in headers if k.lower() != "content-length"]
        if content_length is not None:
            out.append(("content-length", str(content_length)))
        self._stream = self._protocol.response_stream(status, out)

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.send_bytes(data)
        except Exception as exc:  # granian's ProtocolClosed
            self.gone = True
            raise ConnectionResetError("the client left") from exc

    async def end(self, last: bytes) -> None:
        if last:
            await self.write(last)

    def abort(self) -> None:
        self.aborted = True


class GatewayRSGI:
    """RSGI entry to `serve_inference`, on the app's own `GatewayASGI` for start-up."""

    def __init__(self, config: ServegateConfig) -> None:
        self.host = GatewayASGI(config)
        self.watch = os.environ.get("FRONT_WATCH", "task")
        """How a client that leaves is noticed: `task` races the request, in a task of its
        own, with `client_disconnect` (as GatewayASGI races `http.disconnect`); `callback`
        cancels the request's own task from the disconnect future's callback; `0` does
        not notice (a floor: the replica's request then runs to its end)."""

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """granian calls this in the worker, on the loop that will serve: the gateway's
        scrapers and Director live there."""
        loop.run_until_complete(self.host.start())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.host.stop())

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        gw = self.host.gateway
        if gw is None:
            await self.host.start()
            gw = self.host.gateway
            assert gw is not None
        client = scope.client
        sink = RsgiSink(protocol, client.rsplit(":", 1)[0] if client else None)
        kind = INFERENCE_KINDS.get(scope.path)
        if kind is None or scope.method != "POST":
            await send_error(sink, NotFound(f"no route for {scope.method} {scope.path}"))
            return
        headers = CIMultiDict(scope.headers.items())

        async def read_body(settings: GatewaySettings) -> bytes:
            declared = headers.get("content-length")
            limit = settings.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            try:
                async with asyncio.timeout(settings.body_timeout_s):
                    body: bytes = await protocol()
            except TimeoutError as exc:
                raise RequestTimeout("the request body did not arrive in time") from exc
            if len(body) > limit:
                raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            return body

        serve = serve_inference(
            gw.director, sink, kind, scope.method, scope.path, headers, read_body
        )
        if self.watch == "0":
            await serve
            return
        if self.watch == "callback":
            await _cancelled_when_gone(serve, protocol.client_disconnect())
        else:
            await until_done_or_gone(serve, protocol.client_disconnect())
        if sink.aborted:
            raise ConnectionResetError("the answer was cut off")


async def _cancelled_when_gone(serve: Coroutine[Any, Any, object], gone: Any) -> None:
    """`serve` in this task, cancelled by a callback on `gone` (granian's disconnect
    future): no second task, as aiohttp cancels its handler."""
    task = asyncio.current_task()
    assert task is not None

    def left(_: object) -> None:
        task.cancel()

    gone.add_done_callback(left)
    try:
        await serve
    except asyncio.CancelledError:
        if not gone.done() or task.uncancel():
            raise
    finally:
        gone.remove_done_callback(left)
        gone.cancel()


def rsgi_app() -> GatewayRSGI:
    return GatewayRSGI(_config())
