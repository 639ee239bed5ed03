"""Engines as data: where a model server publishes its signals and under which names.

Every engine maps its Prometheus families onto the same engine-neutral
`EndpointMetrics`, so scorers never learn engine names. A signal is a tuple of
`MetricSpec` sources tried in order; the first that yields a value wins (SGLang's
block size comes from `cache_config_info`'s `page_size` label, else the
`sglang:page_size` gauge). Within one source, `names` are alternative spellings of
the same family (old and new vLLM names, SGLang's `sglang_` prefix); the first name
present on a page is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from yarl import URL

from servegate.pool.endpoint import Endpoint


class Aggregation(StrEnum):
    """How the matching series of one family combine into one value."""

    SUM = "sum"
    """Data-parallel engines: requests add up."""
    MEAN = "mean"
    """Data-parallel engines: utilisation averages."""
    MAX = "max"
    LATEST_BY_VALUE = "latest-by-value"
    """The series with the largest value (vLLM's `lora_requests_info`, valued by timestamp)."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One source of one signal."""

    name: str
    alternatives: tuple[str, ...] = ()
    """Other spellings of the same family, tried after `name`."""
    labels: tuple[tuple[str, str], ...] = ()
    """Only series carrying all these label values count (`request_type="waiting"`)."""
    label: str | None = None
    """Read this label's value (a number as text) instead of the sample value."""
    aggregation: Aggregation = Aggregation.SUM
    per: MetricSpec | None = None
    """Divide the value by this source's value (Triton KV usage = used / max)."""
    names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """`name` then `alternatives`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", (self.name, *self.alternatives))

    def families(self) -> tuple[str, ...]:
        """Every family name this source (and its divisor) may read."""
        if self.per is None:
            return self.names
        return (*self.names, *self.per.families())


Signal = tuple[MetricSpec, ...]
"""Sources of one signal in order of preference; empty = the engine does not publish it."""

SIGNALS: tuple[str, ...] = (
    "waiting",
    "running",
    "kv_usage",
    "block_size",
    "num_blocks",
    "lora",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
"""Field names of `EngineSpec` that hold a `Signal`, in `EndpointMetrics` order."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything servegate needs to know about one kind of model server."""

    name: str
    metrics_path: str = "/metrics"
    metrics_port: int | None = None
    """None: the metrics share the API port."""
    health_path: str = "/health"
    health_port: int | None = None
    """None: the health probe uses the API port."""
    openai_models: bool = True
    """The server answers `GET /v1/models` (Triton does not)."""
    waiting: Signal = ()
    running: Signal = ()
    kv_usage: Signal = ()
    block_size: Signal = ()
    num_blocks: Signal = ()
    lora: Signal = ()
    prefix_cache_queries: Signal = ()
    prefix_cache_hits: Signal = ()
    rank_label: str | None = None
    """The label naming the data-parallel rank of an engine series (vLLM: `engine`); with
    it the parser keeps each rank's waiting + running (`EndpointMetrics.rank_load`)."""
    request_adapter: str | None = None
    """The adapter that turns an OpenAI request into this engine's own API and its answer
    back (`triton-generate`: Triton's `generate` / `generate_stream`); None: the engine
    speaks OpenAI and gets the client's bytes as they are."""

    def signal(self, name: str) -> Signal:
        if name not in SIGNALS:
            raise KeyError(f"unknown signal {name!r}; known: {', '.join(SIGNALS)}")
        value: Signal = getattr(self, name)
        return value

    def families(self) -> tuple[str, ...]:
        """Family names this engine's parser must read, without duplicates, in spec order."""
        seen: dict[str, None] = {}
        for signal in SIGNALS:
            for source in self.signal(signal):
                for family in source.families():
                    seen.setdefault(family, None)
        return tuple(seen)

    def metrics_url(self, endpoint: Endpoint) -> str:
        if endpoint.metrics_url:
            return endpoint.metrics_url
        return _derive(endpoint.url, self.metrics_port, self.metrics_path)

    def health_url(self, endpoint: Endpoint) -> str:
        if endpoint.health_url:
            return endpoint.health_url
        return _derive(endpoint.url, self.health_port, self.health_path)

    def models_url(self, endpoint: Endpoint) -> str:
        return _derive(endpoint.url, None, "/v1/models")


def _derive(base: str, port: int | None, path: str) -> str:
    url = URL(base).with_query(None).with_fragment(None)
    if port is not None:
        url = url.with_port(port)
    return str(url.with_path("/" + path.lstrip("/")))
