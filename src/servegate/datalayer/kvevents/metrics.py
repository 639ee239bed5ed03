"""Prometheus exposition of the KV-event subscribers and the prefix indexes they feed.

Computed at scrape time from the plain stats objects; nothing here is on the
event path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servegate.datalayer.kvevents.transport import SubscriberStats


class IndexView(Protocol):
    capacity: int

    @property
    def stats(self) -> Any: ...

    def sizes(self) -> dict[str, int]: ...

    @property
    def speculative_entries(self) -> int: ...


_SUBSCRIBER_COUNTERS = (
    ("messages", "Live KV-event messages received."),
    ("batches", "KV-event batches decoded and applied (live and replayed)."),
    ("gaps", "Jumps in KV-event sequence numbers."),
    ("missed_batches", "KV-event batches lost to gaps and not recovered by replay."),
    ("replays", "Replay requests sent after a gap."),
    ("replayed_batches", "KV-event batches recovered by replay."),
    ("replay_failures", "Replays that failed or timed out."),
    ("restarts", "Publisher restarts seen (sequence number went backwards)."),
    ("sink_errors", "Batches the prefix index failed to apply."),
)


class KVEventsCollector(Collector):
    def __init__(
        self,
        subscribers: Callable[[], Mapping[str, SubscriberStats]],
        indexes: Mapping[str, IndexView],
    ) -> None:
        self._subscribers = subscribers
        self._indexes = indexes

    def collect(self) -> Iterable[Metric]:
        stats = self._subscribers()
        for attr, doc in _SUBSCRIBER_COUNTERS:
            family = CounterMetricFamily(f"servegate_kv_events_{attr}", doc, labels=["endpoint"])
            for name, s in stats.items():
                family.add_metric([name], getattr(s, attr))
            yield family
        events = CounterMetricFamily(
            "servegate_kv_events_events", "KV events applied, by type.", labels=["endpoint", "type"]
        )
        dropped = CounterMetricFamily(
            "servegate_kv_events_dropped",
            "KV-event frames, payloads and events dropped, by reason.",
            labels=["endpoint", "reason"],
        )
        for name, s in stats.items():
            for kind, n in s.events.items():
                events.add_metric([name, kind], n)
            for reason, n in s.dropped.items():
                dropped.add_metric([name, reason], n)
        yield events
        yield dropped

        blocks = GaugeMetricFamily(
            "servegate_prefix_index_blocks",
            "Engine blocks the precise prefix index holds per endpoint (bounded by capacity).",
            labels=["plugin", "endpoint"],
        )
        capacity = GaugeMetricFamily(
            "servegate_prefix_index_capacity_blocks",
            "Most engine blocks the precise prefix index keeps per endpoint.",
            labels=["plugin"],
        )
        speculative = GaugeMetricFamily(
            "servegate_prefix_index_speculative_entries",
            "Speculative (routed, not yet confirmed) block entries.",
            labels=["plugin"],
        )
        counters: dict[str, CounterMetricFamily] = {}
        for plugin, index in self._indexes.items():
            for endpoint, n in index.sizes().items():
                blocks.add_metric([plugin, endpoint], n)
            capacity.add_metric([plugin], index.capacity)
            speculative.add_metric([plugin], index.speculative_entries)
            istats = index.stats
            for f in fields(istats):
                if f.name not in counters:
                    counters[f.name] = CounterMetricFamily(
                        f"servegate_prefix_index_{f.name}",
                        f"Precise prefix index: {f.name.replace('_', ' ')}.",
                        labels=["plugin"],
                    )
                counters[f.name].add_metric([plugin], getattr(istats, f.name))
        yield blocks
        yield capacity
        yield speculative
        yield from counters.values()
