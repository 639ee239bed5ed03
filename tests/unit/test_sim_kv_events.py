"""KV events on a real ZMQ socket, decoded by a plain msgpack reader, rebuild the cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from servegate.simulator.config import parse_sim_config
from servegate.simulator.engine import Engine
from servegate.simulator.kv_events import END_SEQ, ZmqEventPublisher, binds
from servegate.simulator.tokenizer import BuiltinTokenizer

msgpack = pytest.importorskip("msgpack")

BS = 4


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []
    real_socket = ctx.socket

    def tracked(kind: int) -> zmq.Socket[bytes]:
        sock = real_socket(kind)
        sockets.append(sock)
        return sock

    ctx.socket = tracked  # type: ignore[method-assign, assignment]
    yield ctx
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def make(tmp_path: Path, encoding: str) -> tuple[Engine, ZmqEventPublisher]:
    cfg = parse_sim_config(
        {"model": "tiny", "num_blocks": 9, "block_size": BS, "max_model_len": 32, "port": 8100}
    )
    publisher = ZmqEventPublisher(
        f"ipc://{tmp_path}/kv.sock",
        "kv@127.0.0.1:8100@tiny",
        encoding=encoding,
        replay_endpoint=f"ipc://{tmp_path}/replay.sock",
    )
    return Engine(cfg, BuiltinTokenizer(), events=publisher), publisher


def drive(engine: Engine) -> None:
    """Shared prefixes, then enough distinct prompts to force evictions (8 usable blocks)."""
    prompts = [list(range(100, 113)), list(range(100, 113)), [*range(100, 109), 7, 7, 7, 7]]
    prompts += [list(range(1000 * i, 1000 * i + 14)) for i in range(1, 4)]
    for ids in prompts:
        req = engine.submit(ids, request_id=str(ids[0]), max_tokens=3)
        while not req.finished:
            engine.step_now()


def receive(sub: zmq.Socket[bytes], publisher: ZmqEventPublisher) -> list[list[bytes]]:
    deadline = time.monotonic() + 5
    while publisher.published == 0 or publisher.next_seq != publisher.published:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    messages: list[list[bytes]] = []
    while len(messages) < publisher.published:
        assert sub.poll(2000), f"got {len(messages)} of {publisher.published} messages"
        messages.append(sub.recv_multipart())
    return messages


def event_fields(event: Any, encoding: str) -> tuple[str, dict[str, Any]]:
    """An independent reading of one event, per vLLM's field order."""
    if encoding == "map":
        assert isinstance(event, dict)
        return event["type"], event
    assert isinstance(event, list)
    names = {
        "BlockStored": [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[event[0]]
    return event[0], dict(zip(names, event[1:], strict=True))


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_events_rebuild_the_cache(
    tmp_path: Path, zctx: zmq.Context[zmq.Socket[bytes]], encoding: str
) -> None:
    engine, publisher = make(tmp_path, encoding)
    sub = zctx.socket(zmq.SUB)
    sub.connect(f"ipc://{tmp_path}/kv.sock")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.2)  # let the subscription reach the publisher
    try:
        drive(engine)
        messages = receive(sub, publisher)
    finally:
        publisher.close()
    cached: dict[int, list[int]] = {}
    stored: list[dict[str, Any]] = []
    removed = 0
    for seq, (topic, seq_bytes, payload) in enumerate(messages):
        assert topic == b"kv@127.0.0.1:8100@tiny"
        assert int.from_bytes(seq_bytes, "big") == seq
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            kind, f = event_fields(event, encoding)
            if kind == "BlockStored":
                assert (f["block_size"], f["medium"], f["lora_name"]) == (BS, "GPU", None)
                assert len(f["token_ids"]) == BS * len(f["block_hashes"])
                stored.append(f)
                for i, h in enumerate(f["block_hashes"]):
                    cached[h] = f["token_ids"][i * BS : (i + 1) * BS]
            elif kind == "BlockRemoved":
                for h in f["block_hashes"]:
                    del cached[h]
                    removed += 1
    assert removed == engine.kv.evictions > 0
    assert set(cached) == engine.kv.cached_hashes()
    for h, ids in cached.items():
        held = [b for b in (engine.kv.block(i) for i in range(1, 9)) if b.block_hash == h]
        assert held, "a published hash is not in the cache"
        assert len(ids) == BS
    # the first prompt (13 tokens) stores its 3 full blocks at once, chained from no parent
    assert stored[0]["parent_block_hash"] is None
    assert stored[0]["token_ids"] == list(range(100, 112))
    # (its 4th block never fills: the last sampled token is not computed.) The second
    # prompt hits all 3 blocks and stores none; the third shares 2 blocks and adds one
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][1]
    assert stored[1]["token_ids"] == [108, 7, 7, 7]


def test_replay_returns_buffered_batches(
    tmp_path: Path, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    engine, publisher = make(tmp_path, "map")
    sub = zctx.socket(zmq.SUB)
    sub.connect(f"ipc://{tmp_path}/kv.sock")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.2)
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/replay.sock")
    try:
        drive(engine)
        live = receive(sub, publisher)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(2000)
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        publisher.close()
    assert replayed == [(int.from_bytes(s, "big"), p) for _, s, p in live[2:]]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        pytest.param("tcp://*:5557", True, id="wildcard"),
        pytest.param("ipc:///tmp/x", True, id="ipc"),
        pytest.param("tcp://127.0.0.1:5557", False, id="host-connects"),
    ],
)
def test_bind_rule_follows_vllm(endpoint: str, expected: bool) -> None:
    assert binds(endpoint) is expected


def test_tcp_port_zero_binds_a_free_port(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "t", bind=True)
    try:
        host, port = publisher.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        publisher.close()
