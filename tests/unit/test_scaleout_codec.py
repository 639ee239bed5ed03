from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from servegate.pool.endpoint import EndpointMetrics, LoraInfo
from servegate.pool.pool import ModelEntry
from servegate.scaleout.bus import Bus, new_socket
from servegate.scaleout.codec import (
    GONE,
    INFLIGHT,
    METRICS,
    PREFIX,
    DecodeError,
    EndpointReport,
    InFlight,
    Message,
    PrefixInsert,
    decode,
    encode,
    with_hops,
)

REPORT = EndpointReport(
    "10.0.0.1:8000",
    True,
    EndpointMetrics(
        waiting=2.0, running=3.0, kv_usage=0.5, block_size=16, num_blocks=1000,
        lora=LoraInfo(4, frozenset({"a"}), frozenset()), prefix_cache_queries=10.0,
        prefix_cache_hits=4.0, scraped_at=123.5,
    ),
    (ModelEntry("base"), ModelEntry("a", "base")),
)  # fmt: skip


@pytest.mark.parametrize(
    "msg",
    [
        Message(INFLIGHT, "r/w0.1", "default", (InFlight("10.0.0.1:8000", 2, 300),)),
        Message(INFLIGHT, "r/w0.1", "default", ()),
        Message(PREFIX, "r/0", "p", (PrefixInsert("prefix-cache-scorer", "h:1", None, (1, 2**64 - 1)),)),
        Message(PREFIX, "r/0", "p", (PrefixInsert("x", "h:1", 500, ()),), hops=1),
        Message(METRICS, "r/w0.1", "default", (REPORT,)),
        Message(GONE, "r/w1.3", "*"),
    ],
    ids=["inflight", "inflight-empty", "prefix", "prefix-hop", "metrics", "gone"],
)  # fmt: skip
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def test_with_hops_marks_a_bridged_message() -> None:
    msg = Message(GONE, "r/w0.1", "*")
    assert decode(encode(with_hops(msg, 1))).hops == 1


def _packed(*doc: object) -> bytes:
    data: bytes = msgpack.packb(list(doc))
    return data


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe\xfd",
        b"\xc1",
        msgpack.packb({"a": 1}),
        msgpack.packb([1, 2, 3]),
        _packed(2, INFLIGHT, "o", "p", 0, []),
        _packed(1, "nope", "o", "p", 0, []),
        _packed(1, INFLIGHT, "", "p", 0, []),
        _packed(1, INFLIGHT, "o", "p", 2, []),
        _packed(1, INFLIGHT, "o", "p", 0, {}),
        _packed(1, INFLIGHT, "o", "p", 0, [["a", -1, 0]]),
        _packed(1, INFLIGHT, "o", "p", 0, [["a", 1.5, 0]]),
        _packed(1, PREFIX, "o", "p", 0, [["s", "a", None, [-1]]]),
        _packed(1, PREFIX, "o", "p", 0, [["s", "a", 0, [1]]]),
        _packed(1, PREFIX, "o", "p", 0, [["s", "a", None, "keys"]]),
        _packed(1, METRICS, "o", "p", 0, [["a", 1, [], []]]),
        _packed(1, METRICS, "o", "p", 0, [["a", True, [float("nan")] * 9, []]]),
        _packed(1, METRICS, "o", "p", 0, [["a", True, [0, 0, 0, None, None, [1, "x", []], None, None, 0], []]]),
        _packed(1, INFLIGHT, "o" * 1000, "p", 0, []),
        b"\x00" * (5 * 1024 * 1024),
    ],
    ids=[
        "empty", "garbage", "reserved-byte", "map", "short-array", "version", "kind", "no-origin",
        "hops", "body-map", "negative", "float-count", "negative-key", "zero-capacity",
        "keys-string", "healthy-int", "nan-metric", "lora-running-string", "long-origin", "huge",
    ],
)  # fmt: skip
def test_malformed_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


def test_random_bytes_only_ever_raise_decode_error() -> None:
    rng = random.Random(11)
    valid = encode(Message(METRICS, "r/w0.1", "default", (REPORT,)))
    for _ in range(2000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode(bytes(data))
        except DecodeError:
            pass


async def test_bus_counts_garbage_and_skips_its_own_messages() -> None:
    bus = Bus("me/0", new_socket(zmq.PUB), new_socket(zmq.SUB))
    seen: list[Message] = []
    bus.on(GONE, seen.append)
    try:
        bus.deliver(b"\xff garbage")
        bus.deliver(encode(Message(GONE, "me/0", "*")))
        bus.deliver(encode(Message(GONE, "other/0", "*")))
    finally:
        await bus.stop()
    assert bus.stats.invalid == 1
    assert [m.origin for m in seen] == ["other/0"]


async def test_a_failing_handler_is_counted_not_raised() -> None:
    bus = Bus("me/0", new_socket(zmq.PUB), new_socket(zmq.SUB))

    def broken(msg: Message) -> None:
        raise RuntimeError("boom")

    bus.on(GONE, broken)
    try:
        bus.deliver(encode(Message(GONE, "other/0", "*")))
    finally:
        await bus.stop()
    assert bus.stats.handler_errors == 1
