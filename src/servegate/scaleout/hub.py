"""The host's bus hub and replica bridge, run by the supervisor.

Workers publish into `in` (SUB, bound) and everything comes out of `out` (PUB,
bound), so each worker sees every other. With `scaleout.bind` the hub is also
the bridge to peer replicas: messages that originate on this host (hops 0) of
the replicated kinds go out on the replica link; messages from peers come in
with hops 1 and are never sent out again, so a full mesh of peers has no loops.

The ipc hub is not authenticated: it trusts every process that can open its
sockets, so the directory is made owner-only (0700) and the socket files 0600,
and a directory owned by another user is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os

import zmq
import zmq.asyncio

from servegate.scaleout.bus import BusStats, new_socket, send_now
from servegate.scaleout.codec import (
    GONE,
    REPLICATED,
    DecodeError,
    Message,
    decode,
    encode,
    with_hops,
)
from servegate.scaleout.replica import ReplicaLink

log = logging.getLogger("servegate.scaleout")


def owner_only(directory: str) -> None:
    """Make `directory` 0700; `PermissionError` when another user owns it."""
    info = os.stat(directory)
    if info.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not this process")
    os.chmod(directory, 0o700)


class Hub:
    def __init__(self, directory: str, replica_id: str, link: ReplicaLink | None) -> None:
        owner_only(directory)
        self.hub_in = f"ipc://{os.path.join(directory, 'bus-in')}"
        self.hub_out = f"ipc://{os.path.join(directory, 'bus-out')}"
        self.replica_id = replica_id
        self.link = link
        self.stats = BusStats()
        self._in = new_socket(zmq.SUB)
        self._in.bind(self.hub_in)
        self._out = new_socket(zmq.PUB)
        self._out.bind(self.hub_out)
        for name in ("bus-in", "bus-out"):
            os.chmod(os.path.join(directory, name), 0o600)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._local(), name="hub local"))
        if self.link is not None:
            self._tasks.append(loop.create_task(self._remote(), name="hub remote"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._in.close()
        self._out.close()
        if self.link is not None:
            await self.link.stop()

    def gone(self, origin: str) -> None:
        """Tell every worker and peer that `origin` is dead: its in-flight counts are released."""
        data = encode(Message(GONE, origin, "*"))
        send_now(self._out, data)
        if self.link is not None:
            send_now(self.link.pub, data)
        self.stats.sent[GONE] += 1

    async def _local(self) -> None:
        while True:
            data = await self._in.recv()
            try:
                msg = decode(data)
            except DecodeError:
                self.stats.invalid += 1
                continue
            self.stats.received[msg.kind] += 1
            send_now(self._out, data)
            if self.link is not None and msg.hops == 0 and msg.kind in REPLICATED:
                send_now(self.link.pub, data)
                self.stats.sent[msg.kind] += 1

    async def _remote(self) -> None:
        assert self.link is not None
        own = f"{self.replica_id}/"
        while True:
            data = await self.link.sub.recv()
            try:
                msg = decode(data)
            except DecodeError:
                self.stats.invalid += 1
                continue
            if msg.origin.startswith(own) or msg.kind not in REPLICATED or msg.hops:
                continue
            self.stats.received[f"peer {msg.kind}"] += 1
            send_now(self._out, encode(with_hops(msg, 1)))
