"""One process's end of the pub/sub bus.

The same class serves a worker (PUB connected to the host hub's input, SUB to its
output, both `ipc://`) and a single-process replica (PUB bound on `scaleout.bind`,
SUB connected to every peer, `tcp://`). Publishing never blocks: a full queue
drops the message, which costs routing quality for a moment, never a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import cast

import zmq
import zmq.asyncio

from servegate.scaleout.codec import DecodeError, Message, decode, encode

log = logging.getLogger("servegate.scaleout")

Handler = Callable[[Message], None]
SEND_HWM = 100_000
LINGER_MS = 200


def new_socket(kind: int) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if kind in (zmq.PUB, zmq.XPUB):
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    if kind in (zmq.SUB, zmq.XSUB):
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def send_now(sock: zmq.asyncio.Socket, data: bytes) -> bool:
    """Send without waiting; False when the message was not queued (a full or closed socket)."""
    sent = cast("asyncio.Future[object]", sock.send(data, zmq.NOBLOCK))
    if not sent.done():
        sent.cancel()
        return False
    return not sent.cancelled() and sent.exception() is None


class BusStats:
    __slots__ = ("dropped", "handler_errors", "invalid", "received", "sent")

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.invalid = 0
        self.dropped = 0
        self.handler_errors = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "invalid": self.invalid,
            "dropped": self.dropped,
            "handler_errors": self.handler_errors,
        }


class Bus:
    def __init__(self, origin: str, pub: zmq.asyncio.Socket, sub: zmq.asyncio.Socket) -> None:
        self.origin = origin
        self.pub = pub
        self.sub = sub
        self.stats = BusStats()
        self._handlers: dict[str, list[Handler]] = {}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def worker(cls, origin: str, hub_in: str, hub_out: str) -> Bus:
        pub = new_socket(zmq.PUB)
        pub.connect(hub_in)
        sub = new_socket(zmq.SUB)
        sub.connect(hub_out)
        return cls(origin, pub, sub)

    def on(self, kind: str, handler: Handler) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def publish(self, msg: Message) -> None:
        if send_now(self.pub, encode(msg)):
            self.stats.sent[msg.kind] += 1
        else:
            self.stats.dropped += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive(), name="scaleout bus")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.sub.close()
        self.pub.close()

    def deliver(self, data: bytes) -> None:
        """Decode and dispatch one message from the wire; never raises."""
        try:
            msg = decode(data)
        except DecodeError as exc:
            self.stats.invalid += 1
            log.debug("dropped an invalid bus message: %s", exc)
            return
        if msg.origin == self.origin:
            return
        self.stats.received[msg.kind] += 1
        for handler in self._handlers.get(msg.kind, ()):
            try:
                handler(msg)
            except Exception:
                self.stats.handler_errors += 1
                log.exception("scale-out handler failed on a %s message", msg.kind)

    async def _receive(self) -> None:
        while True:
            try:
                data = await self.sub.recv()
            except zmq.ZMQError as exc:
                log.warning("bus receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self.deliver(data)
