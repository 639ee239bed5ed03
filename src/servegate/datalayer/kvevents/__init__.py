"""KV-cache events from model servers, in layers: ZeroMQ transport (frames,
sequence gaps, replay) → engine decoding (vLLM/SGLang msgpack encodings) →
domain events (`scheduling/prefix/events.py`, plain data the pure prefix index reads)
→ the prefix indexes that consume them."""

from servegate.datalayer.kvevents.decode import DecodeError, decode_batch, decode_event
from servegate.datalayer.kvevents.manager import KVEventsManager
from servegate.datalayer.kvevents.metrics import KVEventsCollector
from servegate.datalayer.kvevents.settings import KVEventsSettings
from servegate.datalayer.kvevents.transport import (
    KVEventStream,
    KVEventSubscriber,
    SubscriberStats,
)
from servegate.scheduling.prefix.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Event",
    "EventBatch",
    "KVEventStream",
    "KVEventSubscriber",
    "KVEventsCollector",
    "KVEventsManager",
    "KVEventsSettings",
    "SubscriberStats",
    "decode_batch",
    "decode_event",
]
