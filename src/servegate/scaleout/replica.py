"""The link between replicas: publish on `scaleout.bind`, subscribe to every peer.

Peers come from `scaleout.peers` and, when `scaleout.peer_service` names a
headless Service, from its DNS A records, resolved again every `peer_refresh_s`.
A failed lookup keeps the peers already known. The list may name this replica
itself: receivers drop messages from their own replica by origin.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import zmq
import zmq.asyncio

from servegate.scaleout.bus import new_socket
from servegate.scaleout.settings import ScaleOutSettings

log = logging.getLogger("servegate.scaleout")


async def resolve_service(service: str, port: int) -> set[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(service, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return {f"tcp://{info[4][0]}:{port}" for info in infos}


class ReplicaLink:
    def __init__(self, settings: ScaleOutSettings) -> None:
        assert settings.bind is not None
        self.settings = settings
        self.pub = new_socket(zmq.PUB)
        self.pub.bind(settings.bind)
        self.sub = new_socket(zmq.SUB)
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
