"""API keys, and the tenants they belong to: who a request is, and what it may claim.

A key from `gateway.api_keys` authenticates and nothing more. A key of a tenant
(`tenants:` in the config; keys inline, from files or from environment variables)
also fixes what its requests may claim, whatever headers they send:

- the **fairness id** (flow-control flow) is the tenant's;
- the **priority** (from the objective the request names) is at most `max_priority`;
- `requests_per_minute` / `tokens_per_minute` are token buckets refilled continuously
  (a full minute's worth at most); a request that does not fit gets `429`
  (`rate_limit_error`) with `Retry-After`. Tokens are the prompt plus `max_tokens` at
  arrival, settled against the usage the replica reports when it does.

Keys are compared in constant time, against every key every time; they are never logged
(the config holds them as secrets; the access log names the tenant).
"""

from __future__ import annotations

import hmac
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from servegate.config import ConfigError, ServegateConfig, TenantSettings
from servegate.control.errors import GatewayError, Unauthorized

MINUTE_S = 60.0


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> Mapping[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


@dataclass(slots=True)
class Bucket:
    """`per_minute` units, refilled continuously; may go into debt when usage is settled."""

    per_minute: int
    level: float = field(init=False)
    stamp: float | None = None

    def __post_init__(self) -> None:
        self.level = float(self.per_minute)

    def _refill(self, now: float) -> None:
        if self.stamp is not None:
            rate = self.per_minute / MINUTE_S
            self.level = min(float(self.per_minute), self.level + (now - self.stamp) * rate)
        self.stamp = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 when `amount` fits now (at most a full bucket is asked), else the seconds until
        it would."""
        self._refill(now)
        need = min(amount, float(self.per_minute)) - self.level
        return 0.0 if need <= 0 else need / (self.per_minute / MINUTE_S)

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass(slots=True)
class Tenant:
    name: str
    fairness_id: str
    max_priority: int | None
    requests: Bucket | None = None
    tokens: Bucket | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def admit(self, tokens: int) -> None:
        """Spend one request and `tokens` tokens, or raise `RateLimited`."""
        now = self.clock()
        waits = []
        if self.requests is not None:
            waits.append(("requests", self.requests.wait_s(1, now)))
        if self.tokens is not None:
            waits.append(("tokens", self.tokens.wait_s(tokens, now)))
        over = [(what, s) for what, s in waits if s > 0]
        if over:
            what, wait = max(over, key=lambda x: x[1])
            raise RateLimited(
                f"tenant {self.name!r} is over its {what} per minute; retry in {wait:.1f} s",
                wait,
            )
        if self.requests is not None:
            self.requests.take(1)
        if self.tokens is not None:
            self.tokens.take(tokens)

    def settle(self, estimated: int, actual: int | None) -> None:
        """The replica reported `actual` tokens where `estimated` were charged."""
        if self.tokens is not None and actual is not None:
            self.tokens.take(actual - estimated)


def _keys_of(
    settings: TenantSettings, config_dir: Path | None, environ: Mapping[str, str]
) -> list[str]:
    keys = [k.get_secret_value() for k in settings.keys]
    for name in settings.key_files:
        path = Path(name)
        if not path.is_absolute() and config_dir is not None:
            path = config_dir / path
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(
                f"tenants[{settings.name}].key_files: cannot read {str(path)!r}: "
                f"{exc.strerror or exc}"
            ) from exc
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"tenants[{settings.name}].key_files: {str(path)!r} holds no key")
        keys.extend(found)
    for var in settings.key_env:
        value = environ.get(var, "").strip()
        if not value:
            raise ConfigError(
                f"tenants[{settings.name}].key_env: the environment variable {var} is unset "
                "or empty; set it to the key"
            )
        keys.append(value)
    return keys


class TenantTable:
    """Every accepted key: `gateway.api_keys` (no tenant) and each tenant's."""

    def __init__(self, entries: list[tuple[bytes, Tenant | None]]) -> None:
        self._entries = entries
        self.tenants = {t.name: t for _, t in entries if t is not None}

    @classmethod
    def from_config(
        cls,
        config: ServegateConfig,
        config_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
        previous: TenantTable | None = None,
    ) -> TenantTable:
        """Reads every key now; raises `ConfigError` for a missing file or variable and for
        a key used twice. Rate-limit state carries over from `previous` by tenant name."""
        env = os.environ if environ is None else environ
        entries: list[tuple[bytes, Tenant | None]] = [
            (k.encode(), None) for k in config.gateway.api_keys
        ]
        for settings in config.tenants:
            old = previous.tenants.get(settings.name) if previous is not None else None
            tenant = Tenant(
                name=settings.name,
                fairness_id=settings.fairness_id or settings.name,
                max_priority=settings.max_priority,
                requests=_bucket(settings.requests_per_minute, old.requests if old else None),
                tokens=_bucket(settings.tokens_per_minute, old.tokens if old else None),
            )
            entries.extend((k.encode(), tenant) for k in _keys_of(settings, config_dir, env))
        seen: set[bytes] = set()
        for key, _ in entries:
            if key in seen:
                raise ConfigError(
                    "the same key is configured twice (in gateway.api_keys or tenants); "
                    "every key must name one tenant"
                )
            seen.add(key)
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant of the bearer key in `authorization` (None: a plain API key, or no
        keys configured); `Unauthorized` when keys are configured and it is none of them."""
        if not self._entries:
            return None
        scheme, _, token = authorization.partition(" ")
        supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        found: Tenant | None = None
        for key, tenant in self._entries:
            match = hmac.compare_digest(supplied, key)
            ok |= match
            if match:
                found = tenant
        if not ok or not supplied:
            raise Unauthorized("invalid or missing API key; send 'Authorization: Bearer <key>'")
        return found


def _bucket(per_minute: int | None, old: Bucket | None) -> Bucket | None:
    if per_minute is None:
        return None
    if old is not None and old.per_minute == per_minute:
        return old
    return Bucket(per_minute)
