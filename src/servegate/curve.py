"""ZeroMQ CURVE for servegate's buses: keys from files, a ZAP handler per context.

CURVE (ZMTP's elliptic-curve handshake, libsodium) gives a ZeroMQ connection
mutual authentication and encryption. The server socket holds a secret key;
each client must know the server's public key (so it cannot be talked to by an
impostor) and, here, present a public key the server's ZAP handler lists as
authorized (so no unknown process can subscribe or publish).

Keys are Z85 text (40 characters), one per file, or ZeroMQ certificate files
(`zmq.auth.create_certificates`; `public-key = "..."`, `secret-key = "..."`).
`authorized_keys` entries are files or directories of such files; a directory is
what a Kubernetes Secret volume mount gives (one file per key; the mount's hidden
`..data` entries are skipped). Create a key pair with
`python -m servegate.curve DIR` (writes `bus.key` and `bus.key_secret`).

`CurveKeys` is what a socket needs; `ZapRegistry` runs one ZAP handler thread
per ZeroMQ context, with one domain per server socket, and stops it with the
last socket that used it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from pydantic import BaseModel, ConfigDict, Field
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

KEY_LEN = 40
"""Z85 text of a 32-byte CURVE key."""


class CurveError(ValueError):
    """A key file that cannot be read, or a socket that cannot be secured."""


class CurveSettings(BaseModel):
    """`curve:` under a bus's settings (KV events, scale-out)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret_key_file: str = Field(min_length=1)
    """This process's secret key (Z85 text, or a certificate file with `secret-key`); the
    public key is derived from it."""
    server_key_file: str | None = None
    """Public key of the CURVE servers this process connects to; None = this process's own
    public key (one key pair shared by the whole mesh, e.g. one Kubernetes Secret)."""
    authorized_keys: tuple[str, ...] = ()
    """Files or directories of client public keys allowed to connect to this process's
    bound sockets; empty = only this process's own public key."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes
    secret: bytes
    server: bytes
    """The public key of the servers this side connects to."""
    authorized: frozenset[bytes]
    """Client public keys (Z85) allowed to connect to this side's server sockets."""

    @classmethod
    def load(cls, settings: CurveSettings, base: Path | None = None) -> CurveKeys:
        """Read the key files (relative paths from `base`); `CurveError` names a bad one."""
        if not zmq.has("curve"):
            raise CurveError("this libzmq has no CURVE support")
        secret = _read_key(_path(settings.secret_key_file, base), secret=True)
        public = zmq.curve_public(secret)
        server = (
            public
            if settings.server_key_file is None
            else _read_key(_path(settings.server_key_file, base), secret=False)
        )
        authorized: set[bytes] = set()
        for entry in settings.authorized_keys:
            authorized |= _read_keys(_path(entry, base))
        return cls(public, secret, server, frozenset(authorized or {public}))

    def client(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE client of `server` (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


def _path(name: str, base: Path | None) -> Path:
    path = Path(name)
    return path if path.is_absolute() or base is None else base / path


def _read_key(path: Path, *, secret: bool) -> bytes:
    try:
        text = path.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CurveError(f"cannot read CURVE key {path}: {exc}") from exc
    if len(text) == KEY_LEN and "\n" not in text:
        key = text.encode()
    else:
        try:
            public, private = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise CurveError(f"{path} is neither a Z85 key nor a ZeroMQ certificate") from exc
        found = private if secret else public
        if not found:
            raise CurveError(f"{path} has no {'secret' if secret else 'public'}-key")
        key = found
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, TypeError) as exc:
        raise CurveError(f"{path}: not a Z85 key") from exc
    if len(key) != KEY_LEN:
        raise CurveError(f"{path}: a CURVE key is {KEY_LEN} Z85 characters")
    return key


def _read_keys(path: Path) -> set[bytes]:
    if not path.is_dir():
        return {_read_key(path, secret=False)}
    keys = set()
    for child in sorted(path.iterdir()):
        if child.name.startswith(".") or not child.is_file():
            continue
        keys.add(_read_key(child, secret=False))
    if not keys:
        raise CurveError(f"{path}: no public keys in the directory")
    return keys


class _Allowed:
    """ZAP credentials provider: the callback pyzmq's authenticator calls per handshake."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(keys)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        return False


ZAP_BIND_TRIES = 50
ZAP_BIND_WAIT_S = 0.01
"""A stopped handler's ZAP socket leaves `inproc://zeromq.zap.01` when libzmq's reaper
gets to it, not when `stop()` returns: a handler started right after (the last server
socket on a context closed, then a new one opened) can find the address still taken.
Up to 50 tries 10 ms apart."""


def _start_zap_handler(context: zmq.Context[zmq.Socket[bytes]]) -> ThreadAuthenticator:
    for attempt in range(ZAP_BIND_TRIES):
        auth = ThreadAuthenticator(context, log=logging.getLogger("servegate.curve.zap"))
        try:
            auth.start()
        except zmq.ZMQError as exc:
            if auth.zap_socket is not None:  # created, then its bind failed
                auth.zap_socket.close(linger=0)
            if exc.errno != zmq.EADDRINUSE or attempt == ZAP_BIND_TRIES - 1:
                raise
            time.sleep(ZAP_BIND_WAIT_S)
            continue
        return auth
    raise AssertionError("unreachable")


class _Zap:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.auth = _start_zap_handler(context)
        self.domains: dict[str, _Allowed] = {}


class ZapRegistry:
    """One ZAP handler (a thread) per libzmq context; one domain per server socket."""

    _lock = threading.Lock()
    _zaps: dict[int, _Zap] = {}
    _counter = 0

    @classmethod
    def server(cls, sock: zmq.Socket[Any], keys: CurveKeys) -> str:
        """Make `sock` a CURVE server that admits only `keys.authorized` (before it binds).

        Returns the ZAP domain; pass it to `release` when the socket closes."""
        context = sock.context
        handle = int(context.underlying)
        with cls._lock:
            zap = cls._zaps.get(handle)
            if zap is None:
                zap = cls._zaps[handle] = _Zap(zmq.Context.shadow(handle))
            cls._counter += 1
            domain = f"servegate-{cls._counter}"
            allowed = zap.domains[domain] = _Allowed(keys.authorized)
            zap.auth.configure_curve_callback(domain, allowed)
        sock.zap_domain = domain.encode()
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
        return domain

    @classmethod
    def refused(cls, domain: str) -> int:
        """Handshakes the domain's ZAP handler refused (unknown client keys)."""
        with cls._lock:
            for zap in cls._zaps.values():
                allowed = zap.domains.get(domain)
                if allowed is not None:
                    return allowed.refused
        return 0

    @classmethod
    def release(cls, domain: str) -> None:
        with cls._lock:
            for handle, zap in list(cls._zaps.items()):
                if zap.domains.pop(domain, None) is None:
                    continue
                zap.auth.credentials_providers.pop(domain, None)
                if not zap.domains:
                    zap.auth.stop()
                    del cls._zaps[handle]


def user_id(frame: zmq.Frame) -> str | None:
    """The ZAP user id of the connection a frame came on (the client's Z85 public key under
    CURVE), None when the connection was not authenticated."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) and value else None


def peer_address(frame: zmq.Frame) -> str | None:
    """The IP address of the peer a frame came from (TCP), None when unknown."""
    try:
        value = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) and value else None


def create_keys(directory: str) -> tuple[Path, Path]:
    """Write `bus.key` (public) and `bus.key_secret` (secret) under `directory` (mode 0700)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, "bus")
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


if __name__ == "__main__":  # pragma: no cover - a tiny key tool
    target = sys.argv[1] if len(sys.argv) > 1 else "."
    pub, sec = create_keys(target)
    print(f"public key: {pub}\nsecret key: {sec}")
