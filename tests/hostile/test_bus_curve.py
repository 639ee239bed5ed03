"""The scale-out replica link under CURVE, on real ZeroMQ sockets on 127.0.0.1.

Issue 18 item 5: the bus was plaintext and unauthenticated, so a foreign
subscriber read prefix keys and a foreign publisher injected state. With
`scaleout.curve` a process without an authorized key pair reads nothing and
feeds nothing; without it (the control case) both work, which is what the
tests would see if CURVE were not applied.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from servegate.curve import CurveError, CurveKeys, CurveSettings, create_keys
from servegate.scaleout.bus import new_socket
from servegate.scaleout.codec import INFLIGHT, InFlight, Message, decode, encode
from servegate.scaleout.replica import ReplicaLink
from servegate.scaleout.settings import ScaleOutSettings

TRIES = 100
STEP_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def message(requests: int = 1) -> bytes:
    return encode(Message(INFLIGHT, "a/0", "default", (InFlight("10.0.0.1:8000", requests, 0),)))


@pytest.fixture
def mesh_keys(tmp_path: Path) -> CurveSettings:
    _, secret = create_keys(str(tmp_path / "mesh"))
    return CurveSettings(secret_key_file=str(secret))


@pytest.fixture
def foreign_keys(tmp_path: Path, mesh_keys: CurveSettings) -> CurveKeys:
    """A valid key pair that is not authorized, which knows the mesh's public key."""
    _, secret = create_keys(str(tmp_path / "foreign"))
    public = tmp_path / "mesh" / "bus.key"
    return CurveKeys.load(CurveSettings(secret_key_file=str(secret), server_key_file=str(public)))


async def drain(sock: zmq.asyncio.Socket) -> list[bytes]:
    out = []
    while await sock.poll(0):
        out.append(await sock.recv())
    return out


async def pump(
    send: zmq.asyncio.Socket,
    data: bytes,
    listeners: list[zmq.asyncio.Socket],
    until: int,
    also: Callable[[], bool] = lambda: True,
) -> list[list[bytes]]:
    """Send `data` every step until listener `until` has it and `also()` holds (or the tries
    run out: a bounded wait, not a timing assertion)."""
    got: list[list[bytes]] = [[] for _ in listeners]
    for _ in range(TRIES):
        await send.send(data)
        await asyncio.sleep(STEP_S)
        for i, sock in enumerate(listeners):
            got[i].extend(await drain(sock))
        if got[until] and also():
            break
    return got


def link(bind: str, peers: list[str], curve: CurveSettings | None) -> ReplicaLink:
    return ReplicaLink(ScaleOutSettings(bind=bind, peers=tuple(peers), curve=curve))


@pytest.fixture
async def links(mesh_keys: CurveSettings) -> AsyncIterator[tuple[ReplicaLink, ReplicaLink]]:
    a_addr, b_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = link(a_addr, [b_addr], mesh_keys)
    b = link(b_addr, [a_addr], mesh_keys)
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


async def test_a_foreign_subscriber_reads_nothing(
    links: tuple[ReplicaLink, ReplicaLink], foreign_keys: CurveKeys
) -> None:
    a, b = links
    bind = a.settings.bind
    assert bind is not None
    plain = new_socket(zmq.SUB)
    plain.connect(bind)
    keyed = new_socket(zmq.SUB)
    foreign_keys.client(keyed)
    keyed.connect(bind)
    try:
        got = await pump(
            a.pub, message(), [b.sub, plain, keyed], until=0, also=lambda: a.refused >= 1
        )
        assert got[0], "the authorized peer must receive"
        assert decode(got[0][0]).kind == INFLIGHT
        assert got[1] == [] and got[2] == []
        assert a.refused >= 1  # the unauthorized key was turned away by ZAP
    finally:
        plain.close(0)
        keyed.close(0)


async def test_a_foreign_publisher_at_a_peer_address_is_not_heard(
    mesh_keys: CurveSettings, foreign_keys: CurveKeys
) -> None:
    own, fake_plain, fake_keyed = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    victim = link(own, [fake_plain, fake_keyed], mesh_keys)
    await victim.start()
    plain = new_socket(zmq.PUB)
    plain.bind(fake_plain)
    keyed = new_socket(zmq.PUB)
    keyed.curve_secretkey = foreign_keys.secret
    keyed.curve_publickey = foreign_keys.public
    keyed.curve_server = True
    keyed.bind(fake_keyed)
    try:
        got: list[bytes] = []
        for _ in range(20):
            await plain.send(message((1 << 64) - 1))
            await keyed.send(message(10**6))
            await asyncio.sleep(STEP_S)
            got.extend(await drain(victim.sub))
        assert got == []
    finally:
        plain.close(0)
        keyed.close(0)
        await victim.stop()


async def test_control_without_curve_a_foreign_publisher_is_heard() -> None:
    """What the link did before `scaleout.curve`, and still does without it (with a warning)."""
    own, fake = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    victim = link(own, [fake], None)
    await victim.start()
    plain = new_socket(zmq.PUB)
    plain.bind(fake)
    try:
        got = await pump(plain, message(), [victim.sub], until=0)
        assert got[0]
    finally:
        plain.close(0)
        await victim.stop()


def test_bad_key_files_are_refused_with_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    with pytest.raises(CurveError, match=r"bad\.key"):
        CurveKeys.load(CurveSettings(secret_key_file=str(bad)))
    with pytest.raises(CurveError, match="cannot read"):
        CurveKeys.load(CurveSettings(secret_key_file=str(tmp_path / "missing")))


def test_keys_load_from_a_secret_mount_with_z85_files(tmp_path: Path) -> None:
    """A Kubernetes Secret volume: one file per key, plus the mount's hidden `..data` entries."""
    secret_z85, public_z85 = zmq.curve_keypair()[::-1]
    mount = tmp_path / "secret"
    (mount / "..2026_12_02").mkdir(parents=True)
    (mount / "secret-key").write_bytes(secret_z85 + b"\n")
    clients = tmp_path / "clients"
    clients.mkdir()
    other_public, _ = zmq.curve_keypair()
    (clients / "replica-a").write_bytes(public_z85)
    (clients / "replica-b").write_bytes(other_public)
    (clients / "..data").mkdir()
    keys = CurveKeys.load(
        CurveSettings(secret_key_file=str(mount / "secret-key"), authorized_keys=(str(clients),))
    )
    assert keys.public == public_z85 and keys.server == public_z85
    assert keys.authorized == {public_z85, other_public}
