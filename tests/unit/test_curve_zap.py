"""The ZAP handler a CURVE server socket needs, started while a stopped one's socket is
still leaving its inproc address (the race that failed the hostile tier once)."""

from __future__ import annotations

import threading

import pytest
import zmq

from servegate import curve
from servegate.curve import CurveKeys, ZapRegistry

ZAP_ADDRESS = "inproc://zeromq.zap.01"


def terminate(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Terminate `context`, failing (not hanging) when a socket on it was left open."""
    done = threading.Event()

    def term() -> None:
        context.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    assert done.wait(5.0), "a socket was left open on the context (a half-made ZAP socket)"


def server_keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public=public, secret=secret, server=public, authorized=frozenset())


def test_a_zap_handler_starts_once_the_address_is_free_again() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    holder = context.socket(zmq.REP)
    holder.bind(ZAP_ADDRESS)  # a previous handler's socket, not yet reaped
    threading.Timer(0.05, lambda: holder.close(linger=0)).start()
    sock = context.socket(zmq.SUB)
    try:
        domain = ZapRegistry.server(sock, server_keys())
        ZapRegistry.release(domain)
    finally:
        sock.close(linger=0)
        holder.close(linger=0)
        terminate(context)


def test_an_address_that_stays_taken_fails_without_leaking_a_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(curve, "ZAP_BIND_TRIES", 3)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    holder = context.socket(zmq.REP)
    holder.bind(ZAP_ADDRESS)
    sock = context.socket(zmq.SUB)
    try:
        with pytest.raises(zmq.ZMQError) as failed:
            ZapRegistry.server(sock, server_keys())
        assert failed.value.errno == zmq.EADDRINUSE
    finally:
        sock.close(linger=0)
        holder.close(linger=0)
        terminate(context)
