"""Everything one simulated server owns, in one object the routes share."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from servegate.simulator.config import SimConfig
from servegate.simulator.engine import Engine
from servegate.simulator.faults import FaultState
from servegate.simulator.hf_tokenizer import load_tokenizer
from servegate.simulator.kv_events import ZmqEventPublisher
from servegate.simulator.loop_lag import LoopLagMonitor
from servegate.simulator.metrics import build_registry
from servegate.simulator.personas import PersonaSpec, persona_spec
from servegate.simulator.tokenizer import Tokenizer


class SimState:
    def __init__(self, cfg: SimConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.persona: PersonaSpec = persona_spec(cfg.persona)
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer.path)
        self.publisher: ZmqEventPublisher | None = None
        self.engine = Engine(cfg, self.tokenizer)
        self.registry: CollectorRegistry = build_registry(self.engine)
        self.faults = FaultState(
            cfg.faults.error_rate,
            list(cfg.faults.error_kinds),
            cfg.faults.startup_delay_s,
            cfg.seed,
        )
        self.faults.listeners.append(self._on_fault)
        self.crashed = False
        self.crash_hooks: list[Callable[[bool], None]] = []
        """Called with `exit_process` when a crash is requested (the server closes sockets)."""
        self.started_at = int(time.time())
        self.loop_lag = LoopLagMonitor()
        self._ids = random.Random(cfg.seed ^ 0x1D5)

    def attach_publisher(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.engine.events = publisher

    def new_id(self) -> str:
        return f"{self._ids.getrandbits(128):032x}"

    def _on_fault(self, faults: FaultState) -> None:
        self.engine.slow_factor = faults.factor
        if faults.mode == "hang":
            self.engine.pause()
        else:
            self.engine.resume()

    def crash(self, exit_process: bool) -> None:
        """Die like a killed server: the engine stops, every connection drops."""
        if self.crashed:
            return
        self.crashed = True
        self.faults.mode = "crash"
        self.engine.kill()
        if self.publisher is not None:
            self.publisher.close()
        for hook in self.crash_hooks:
            hook(exit_process)
