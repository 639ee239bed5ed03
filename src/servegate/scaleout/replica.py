"""The link between replicas: publish on `scaleout.bind`, subscribe to every peer.

Peers come from `scaleout.peers` and, when `scaleout.peer_service` names a
headless Service, from its DNS A records, resolved again every `peer_refresh_s`.
A failed lookup keeps the peers already known. The list may name this replica
itself: receivers drop messages from their own replica by origin.

With `scaleout.curve` both sockets use ZeroMQ CURVE: the bound PUB is a CURVE
server whose ZAP handler admits only authorized client keys (so no foreign
process can read the bus), and the SUB is a CURVE client that checks each peer's
server key (so nothing but a real peer can feed it). Without it the link is
plaintext and unauthenticated, and a warning says so.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import zmq
import zmq.asyncio

from servegate.curve import CurveKeys, ZapRegistry
from servegate.scaleout.bus import new_socket
from servegate.scaleout.codec import MAX_MESSAGE_BYTES
from servegate.scaleout.settings import ScaleOutSettings

log = logging.getLogger("servegate.scaleout")

LINK_MAX_BYTES = 4 * MAX_MESSAGE_BYTES
"""Frames larger than this from a peer replica end the connection inside libzmq."""


async def resolve_service(service: str, port: int) -> set[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(service, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return {f"tcp://{info[4][0]}:{port}" for info in infos}


class ReplicaLink:
    def __init__(self, settings: ScaleOutSettings) -> None:
        assert settings.bind is not None
        self.settings = settings
        self.keys = CurveKeys.load(settings.curve) if settings.curve is not None else None
        self.pub = new_socket(zmq.PUB)
        self._domain: str | None = None
        if self.keys is not None:
            self._domain = ZapRegistry.server(self.pub, self.keys)
        else:
            log.warning(
                "scale-out replica link on %s is plaintext and unauthenticated: anyone who "
                "can reach it can read prefix keys and in-flight counts, and a process at a "
                "peer address can inject state; set scaleout.curve (docs/scaleout.md)",
                settings.bind,
            )
        self.pub.bind(settings.bind)
        self.sub = new_socket(zmq.SUB)
        # libzmq drops a peer that sends more than this before buffering it (and does not
        # reconnect to it); messages up to it are read and refused by the decoder's limit
        self.sub.setsockopt(zmq.MAXMSGSIZE, LINK_MAX_BYTES)
        if self.keys is not None:
            self.keys.client(self.sub)
        self.connected: set[str] = set()
        self.lookup_failures = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        if self.settings.peer_service:
            self._task = asyncio.get_running_loop().create_task(
                self._refresh_forever(), name="scaleout peers"
            )

    async def refresh(self) -> None:
        wanted = set(self.settings.peers)
        service = self.settings.peer_service
        if service:
            try:
                wanted |= await resolve_service(service, self.settings.peer_port)
            except OSError as exc:
                self.lookup_failures += 1
                log.warning("cannot resolve peer service %s: %s; keeping known peers", service, exc)
                wanted |= self.connected
        for peer in sorted(wanted - self.connected):
            self.sub.connect(peer)
        for peer in sorted(self.connected - wanted):
            try:
                self.sub.disconnect(peer)
            except zmq.ZMQError:
                pass
        if wanted != self.connected:
            log.info("scale-out peers: %s", sorted(wanted))
        self.connected = wanted

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.peer_refresh_s)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sub.close()
        self.pub.close()
        if self._domain is not None:
            ZapRegistry.release(self._domain)
            self._domain = None

    @property
    def refused(self) -> int:
        """Subscribers the CURVE handshake turned away (unknown keys)."""
        return ZapRegistry.refused(self._domain) if self._domain is not None else 0
