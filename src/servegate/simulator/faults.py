"""Faults on demand, for the gateway's retry, health and circuit-breaking tests.

Modes (set with `POST /admin/fault {"mode": ..., "duration_s": optional}`):

- `none`: normal service.
- `hang`: every non-admin request waits until the mode changes; the engine stops
  stepping, so open streams stall.
- `crash`: all connections close abruptly and the server stops listening; the
  process exits instead with `"exit": true` or `faults.crash_exits_process`.
- `unavailable`: every non-admin request answers 503.
- `slow`: every engine step lasts `factor` times longer (default 10).

Per-request faults: `error_rate` x `error_kinds` from the config, or the
`X-Return-Error: <status | disconnect | stream_error | stream_cut>` header.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

FaultMode = Literal["none", "hang", "crash", "unavailable", "slow"]
MODES: tuple[str, ...] = ("none", "hang", "crash", "unavailable", "slow")
REQUEST_FAULTS: tuple[str, ...] = ("disconnect", "stream_error", "stream_cut")

InjectedFault = int | str


@dataclass(frozen=True, slots=True)
class FaultCommand:
    mode: FaultMode
    duration_s: float | None = None
    factor: float = 10.0
    exit: bool | None = None

    @classmethod
    def parse(cls, body: Any) -> FaultCommand:
        if not isinstance(body, dict):
            raise ValueError('expected a JSON object like {"mode": "hang"}')
        unknown = set(body) - {"mode", "duration_s", "factor", "exit"}
        if unknown:
            raise ValueError(
                f"unknown field(s) {sorted(unknown)}; allowed: mode, duration_s, factor, exit"
            )
        mode = body.get("mode")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, not {mode!r}")
        duration = body.get("duration_s")
        if duration is not None and (not isinstance(duration, int | float) or duration <= 0):
            raise ValueError("duration_s must be a positive number")
        factor = body.get("factor", 10.0)
        if not isinstance(factor, int | float) or factor <= 0:
            raise ValueError("factor must be a positive number")
        exit_ = body.get("exit")
        if exit_ is not None and not isinstance(exit_, bool):
            raise ValueError("exit must be true or false")
        return cls(
            mode=mode,
            duration_s=None if duration is None else float(duration),
            factor=float(factor),
            exit=exit_,
        )


def parse_injected(value: str) -> InjectedFault | None:
    """The fault an `X-Return-Error` header asks for; None if it names none."""
    value = value.strip()
    if value.isdigit():
        status = int(value)
        return status if 400 <= status <= 599 else None
    return value if value in REQUEST_FAULTS else None


class FaultState:
    def __init__(
        self, error_rate: float, error_kinds: list[int | str], startup_delay_s: float, seed: int
    ) -> None:
        self.mode: FaultMode = "none"
        self.factor = 1.0
        self.error_rate = error_rate
        self.error_kinds = list(error_kinds)
        self.ready_at = time.monotonic() + startup_delay_s
        self._rng = random.Random(seed ^ 0xFA017)
        self._released = asyncio.Event()
        self._released.set()
        self._revert: asyncio.TimerHandle | None = None
        self.injected = 0
        self.listeners: list[Callable[[FaultState], None]] = []

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    @property
    def hanging(self) -> bool:
        return self.mode == "hang"

    async def wait_unhung(self) -> None:
        await self._released.wait()

    def apply(self, command: FaultCommand) -> None:
        if self._revert is not None:
            self._revert.cancel()
            self._revert = None
        self.mode = command.mode
        self.factor = command.factor if command.mode == "slow" else 1.0
        if command.mode == "hang":
            self._released.clear()
        else:
            self._released.set()
        if command.duration_s is not None and command.mode not in ("none", "crash"):
            self._revert = asyncio.get_running_loop().call_later(
                command.duration_s, self.apply, FaultCommand(mode="none")
            )
        for listener in self.listeners:
            listener(self)

    def roll(self) -> InjectedFault | None:
        """The configured random fault for one request, if this one gets one."""
        if self.error_rate <= 0 or self._rng.random() >= self.error_rate:
            return None
        self.injected += 1
        return self._rng.choice(self.error_kinds)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "factor": self.factor,
            "ready": self.ready,
            "error_rate": self.error_rate,
            "error_kinds": self.error_kinds,
            "injected": self.injected,
        }
