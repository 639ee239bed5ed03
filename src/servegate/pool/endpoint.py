"""Endpoint identity and live state.

`Endpoint` is what discovery knows (immutable); `EndpointState` is what the data
layer and the gateway learn while it runs. The scheduler reads `EndpointState`
objects directly: it runs synchronously on the event loop, so during one
scheduling cycle nothing else can change them, which makes the live objects a
consistent snapshot without copying a hundred of them per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

ROLE_LABEL = "llm-d.ai/role"
ENGINE_LABEL = "llm-d.ai/engine-type"
MODEL_LABEL = "llm-d.ai/model"


class Role(StrEnum):
    """`llm-d.ai/role`; an endpoint without the label does both."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "prefill-decode"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A model-server replica (one data-parallel rank of one pod).

    `address` is the `host:port` used in `x-gateway-destination-endpoint`.
    """

    address: str
    url: str
    engine: str = "vllm"
    role: Role = Role.BOTH
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    metrics_url: str | None = None
    health_url: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    pool: str = "default"

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass(slots=True)
class LoraInfo:
    """vLLM's `lora_requests_info`: adapters with requests in flight, not all loaded ones."""

    max_lora: int
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()


@dataclass(slots=True)
class EndpointMetrics:
    """The engine-neutral view of one scrape; every scorer reads only this."""

    waiting: float = 0.0
    """Requests queued in the engine (summed over data-parallel engines)."""
    running: float = 0.0
    """Requests the engine is running (summed over data-parallel engines)."""
    kv_usage: float = 0.0
    """KV-cache utilisation in [0, 1] (averaged over data-parallel engines)."""
    block_size: int | None = None
    """Tokens per KV block, when the engine publishes its cache geometry."""
    num_blocks: int | None = None
    """KV blocks on the accelerator, when published."""
    lora: LoraInfo | None = None
    """LoRA slot state (vLLM only)."""
    prefix_cache_queries: float | None = None
    """Prompt tokens looked up in the prefix cache (counter)."""
    prefix_cache_hits: float | None = None
    """Prompt tokens found in the prefix cache (counter)."""
    scraped_at: float = 0.0
    """`time.monotonic()` of the scrape that produced these values; 0 = never."""
    rank_load: dict[int, float] | None = None
    """Data-parallel ranks behind one API server (vLLM's `engine` label): rank → waiting +
    running; None when the page shows one rank or none."""


@dataclass(slots=True, eq=False)
class EndpointState:
    """Live state of one endpoint; owned and mutated by the `Pool` only."""

    endpoint: Endpoint
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    healthy: bool = False
    """Active health: the health probe's verdict after its thresholds."""
    draining: bool = False
    """Set by an operator: takes no new requests, finishes what it has."""
    ejected_until: float = 0.0
    """Passive health: outlier ejection until this monotonic time."""
    in_flight_requests: int = 0
    """This router's requests in flight to the endpoint, plus its scale-out peers'."""
    in_flight_tokens: int = 0
    local_in_flight_requests: int = 0
    """This process's share of `in_flight_requests` (the rest: `peer_in_flight_requests`)."""
    local_in_flight_tokens: int = 0
    peer_in_flight_requests: int = 0
    peer_in_flight_tokens: int = 0
    last_picked_at: float = 0.0
    served_models: frozenset[str] = frozenset()
    """Model ids from the replica's `/v1/models` (base model and LoRA adapters)."""
    picks: int = 0

    @property
    def address(self) -> str:
        return self.endpoint.address

    def is_fresh(self, now: float, staleness: float) -> bool:
        return self.metrics.scraped_at > 0.0 and now - self.metrics.scraped_at <= staleness
