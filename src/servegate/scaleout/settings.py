"""`scaleout:` in servegate's YAML, and the identity a supervisor hands each worker.

    scaleout:
      workers: 4                      # processes on one port (SO_REUSEPORT), supervised
      bind: tcp://0.0.0.0:7700        # this replica's bus, for peer replicas to subscribe to
      peers: [tcp://gw-1:7700]        # static peer replicas (this replica's own address is ignored)
      peer_service: servegate-peers.llm.svc.cluster.local   # or a headless Service (DNS A records)
      curve:                          # authenticate + encrypt the replica link (docs/scaleout.md)
        secret_key_file: /etc/servegate/bus/bus.key_secret
      prefix_key_file: /etc/servegate/bus/prefix.key   # keyed prefix hashes

With one worker and no `bind` nothing changes: the gateway runs as one process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servegate.curve import CurveSettings

WORKER_ENV = "SERVEGATE_WORKER"
"""Set by the supervisor in each worker's environment (JSON); no `__`, so not a config override."""


class ScaleOutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(1, ge=1, le=256)
    """Gateway processes sharing the listening port; more than one starts a supervisor."""
    replica_id: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Names this replica in bus messages; None = host name plus a random suffix."""
    bind: str | None = None
    """`tcp://host:port` where this replica publishes to its peers; None = no replica sharing."""
    peers: tuple[str, ...] = ()
    """`tcp://host:port` of peer replicas (the list may include this replica's own address)."""
    peer_service: str | None = None
    """A Kubernetes headless Service name: its A records are peers, on `peer_port`."""
    peer_port: int = Field(7700, ge=1, le=65535)
    peer_refresh_s: float = Field(10.0, gt=0)
    """How often `peer_service` is resolved again."""
    heartbeat_s: float = Field(0.5, gt=0)
    """Every process re-sends its whole in-flight snapshot this often; it is also its heartbeat."""
    expiry_s: float = Field(2.0, gt=0)
    """A peer silent this long is dropped and its in-flight counts are released."""
    coalesce_s: float = Field(0.002, ge=0, le=1.0)
    """Changes within this window go out in one message."""
    leader_takeover_s: float = Field(3.0, gt=0)
    """A follower worker that has heard no shared metrics for this long scrapes on its own."""
    restart_backoff_s: float = Field(0.5, gt=0)
    restart_backoff_max_s: float = Field(10.0, gt=0)
    curve: CurveSettings | None = None
    """ZeroMQ CURVE on the replica link (`bind`/`peers`): only processes holding an authorized
    key pair can subscribe or publish, and the traffic is encrypted. None = plaintext and
    unauthenticated (a warning at start); the host's ipc hub is owner-only either way."""
    prefix_key_file: str | None = None
    """A shared secret (any bytes, at least 16): prefix-cache block keys are computed with a
    seed derived from it, so a listener cannot confirm a guessed prompt from the keys on the
    bus. Every worker and replica must use the same file."""
    max_peers: int = Field(1024, ge=1, le=65536)
    """Origins (worker processes, here and on peer replicas) tracked at once; state from more
    is ignored and counted."""

    @field_validator("bind")
    @classmethod
    def _bind_is_tcp(cls, value: str | None) -> str | None:
        if value is not None:
            _check_tcp(value, "bind")
        return value

    @field_validator("peers")
    @classmethod
    def _peers_are_tcp(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for peer in value:
            _check_tcp(peer, "peers")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ScaleOutSettings:
        if (self.peers or self.peer_service) and self.bind is None:
            raise ValueError("scaleout.peers/peer_service need scaleout.bind (where peers listen)")
        if self.expiry_s <= self.heartbeat_s:
            raise ValueError("scaleout.expiry_s must be longer than scaleout.heartbeat_s")
        return self

    @property
    def replicates(self) -> bool:
        return self.bind is not None


def _check_tcp(value: str, field: str) -> None:
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"scaleout.{field}: {value!r} is not tcp://host:port")


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What the supervisor tells a worker: who it is and where the host's bus hub listens."""

    index: int
    origin: str
    replica_id: str
    hub_in: str
    hub_out: str
    config_path: str
    """The resolved config, written by the supervisor (JSON)."""
    config_dir: str | None
    config_file: str | None = None
    """The YAML file a SIGHUP reloads, with `overrides` on top; None = no reloading."""
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def leader(self) -> bool:
        return self.index == 0

    def to_env(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "origin": self.origin,
                "replica_id": self.replica_id,
                "hub_in": self.hub_in,
                "hub_out": self.hub_out,
                "config_path": self.config_path,
                "config_dir": self.config_dir,
                "config_file": self.config_file,
                "overrides": dict(self.overrides),
            }
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WorkerIdentity | None:
        raw = (os.environ if environ is None else environ).get(WORKER_ENV)
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(
                index=int(doc["index"]),
                origin=str(doc["origin"]),
                replica_id=str(doc["replica_id"]),
                hub_in=str(doc["hub_in"]),
                hub_out=str(doc["hub_out"]),
                config_path=str(doc["config_path"]),
                config_dir=None if doc.get("config_dir") is None else str(doc["config_dir"]),
                config_file=None if doc.get("config_file") is None else str(doc["config_file"]),
                overrides=dict(doc.get("overrides") or {}),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{WORKER_ENV} is not a worker identity: {exc}") from exc
