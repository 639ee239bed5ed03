"""Peer discovery of a replica link: static peers plus a headless Service's A records."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from servegate.scaleout import replica
from servegate.scaleout.replica import ReplicaLink, resolve_service
from servegate.scaleout.settings import ScaleOutSettings

STATIC = "tcp://127.0.0.1:7001"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeDns:
    def __init__(self) -> None:
        self.answers: list[set[str] | OSError] = []

    async def __call__(self, service: str, port: int) -> set[str]:
        answer = self.answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> FakeDns:
    fake = FakeDns()
    monkeypatch.setattr(replica, "resolve_service", fake)
    return fake


@pytest.fixture
async def link() -> AsyncIterator[ReplicaLink]:
    settings = ScaleOutSettings(
        bind=f"tcp://127.0.0.1:{free_port()}",
        peers=(STATIC,),
        peer_service="peers.example.svc",
        peer_refresh_s=3600,
    )
    link = ReplicaLink(settings)
    yield link
    await link.stop()


async def test_a_name_resolves_to_tcp_addresses_on_the_peer_port() -> None:
    assert await resolve_service("localhost", 7700) == {"tcp://127.0.0.1:7700"}


@pytest.mark.parametrize(
    ("answers", "connected", "failures"),
    [
        ([{"tcp://10.0.0.1:7700"}], {STATIC, "tcp://10.0.0.1:7700"}, 0),
        (
            [{"tcp://10.0.0.1:7700"}, {"tcp://10.0.0.2:7700"}],
            {STATIC, "tcp://10.0.0.2:7700"},
            0,
        ),
        ([{"tcp://10.0.0.1:7700"}, OSError("SERVFAIL")], {STATIC, "tcp://10.0.0.1:7700"}, 1),
        ([OSError("NXDOMAIN")], {STATIC}, 1),
        ([{"tcp://10.0.0.1:7700"}, set()], {STATIC}, 0),
    ],
    ids=["first-lookup", "records-change", "failed-lookup-keeps-peers", "never-resolved",
         "records-gone"],
)  # fmt: skip
async def test_refresh_follows_the_records_and_keeps_peers_when_a_lookup_fails(
    dns: FakeDns,
    link: ReplicaLink,
    answers: list[set[str] | OSError],
    connected: set[str],
    failures: int,
) -> None:
    dns.answers = list(answers)
    for _ in answers:
        await link.refresh()
    assert link.connected == connected
    assert link.lookup_failures == failures
