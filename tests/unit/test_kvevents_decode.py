"""Decoding KV-event payloads: both encodings, real vLLM 0.32 bytes, and hostile input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servegate.datalayer.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
)
from servegate.datalayer.kvevents.decode import REASONS

FIXTURES = Path(__file__).parents[1] / "fixtures" / "real" / "kv_events"
TOKENS = list(range(100, 132))
SHA = bytes(range(32))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": TOKENS,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
STORED_ARRAY = ["BlockStored", [11, 12], None, TOKENS, 16, None, "GPU", None]


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        pytest.param(
            [1.5, [STORED_MAP], 0],
            BlockStored([11, 12], None, TOKENS, 16, None, None, "GPU"),
            id="vllm-map-event-array-batch",
        ),
        pytest.param(
            [1.5, [STORED_ARRAY]],
            BlockStored([11, 12], None, TOKENS, 16, None, None, "GPU"),
            id="array-event-no-rank",
        ),
        pytest.param(
            {"ts": 1.5, "events": [STORED_ARRAY], "data_parallel_rank": 0},
            BlockStored([11, 12], None, TOKENS, 16, None, None, "GPU"),
            id="map-batch",
        ),
        pytest.param(
            [1, [["BlockStored", [SHA], SHA, TOKENS[:16], 16, 3, "CPU", "a1"]]],
            BlockStored([SHA], SHA, TOKENS[:16], 16, 3, "a1", "CPU"),
            id="bytes-hashes-lora-cpu",
        ),
        pytest.param(
            [1.5, [{"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}]],
            BlockRemoved([11], "GPU"),
            id="removed-map",
        ),
        pytest.param(
            [1.5, [["BlockRemoved", [SHA]]]], BlockRemoved([SHA], None), id="removed-array-short"
        ),
        pytest.param([1.5, [{"type": "AllBlocksCleared"}]], AllBlocksCleared(), id="cleared-map"),
        pytest.param([1.5, [["AllBlocksCleared"]]], AllBlocksCleared(), id="cleared-array"),
    ],
)
def test_both_encodings_decode_to_the_same_events(batch: Any, expected: Any) -> None:
    decoded = decode_batch(pack(batch))
    assert decoded.dropped == []
    (event,) = decoded.events
    if isinstance(expected, BlockStored):
        assert isinstance(event, BlockStored)
        assert list(event.token_ids) == list(expected.token_ids)
        event = BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.lora_name,
            event.medium,
        )
        expected = BlockStored(
            list(expected.block_hashes),
            expected.parent_block_hash,
            list(expected.token_ids),
            expected.block_size,
            expected.lora_id,
            expected.lora_name,
            expected.medium,
        )
    assert event == expected


def test_data_parallel_rank_and_timestamp_are_kept() -> None:
    decoded = decode_batch(pack([12.25, [], 3]))
    assert (decoded.ts, decoded.data_parallel_rank, decoded.events) == (12.25, 3, [])


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        pytest.param({"type": "Nope"}, "unknown-event-type", id="unknown-type"),
        pytest.param({"block_hashes": [1]}, "bad-event", id="no-tag"),
        pytest.param(42, "bad-event", id="not-a-container"),
        pytest.param([], "bad-event", id="empty-array"),
        pytest.param({**STORED_MAP, "block_hashes": "x"}, "bad-block-hashes", id="hashes-str"),
        pytest.param({**STORED_MAP, "block_hashes": [1.5, 2]}, "bad-block-hashes", id="hash-f"),
        pytest.param({**STORED_MAP, "parent_block_hash": "p"}, "bad-block-hashes", id="parent"),
        pytest.param({**STORED_MAP, "block_size": 0}, "bad-block-size", id="block-size-0"),
        pytest.param({**STORED_MAP, "block_size": True}, "bad-block-size", id="block-size-bool"),
        # 2 hashes x 16 = 32 tokens expected, 31 given
        pytest.param({**STORED_MAP, "token_ids": TOKENS[:31]}, "token-count-mismatch", id="count"),
        pytest.param({**STORED_MAP, "token_ids": [-1] * 32}, "bad-token-ids", id="negative-ids"),
        pytest.param({**STORED_MAP, "token_ids": [2**32] * 32}, "bad-token-ids", id="huge-ids"),
        pytest.param({**STORED_MAP, "token_ids": ["a"] * 32}, "bad-token-ids", id="str-ids"),
        pytest.param({**STORED_MAP, "token_ids": 7}, "bad-token-ids", id="ids-not-list"),
        pytest.param({**STORED_MAP, "lora_name": 5}, "bad-field", id="lora-name-int"),
        pytest.param({**STORED_MAP, "medium": ["GPU"]}, "bad-field", id="medium-list"),
    ],
)
def test_a_bad_event_is_dropped_with_its_reason_and_the_rest_kept(event: Any, reason: str) -> None:
    decoded = decode_batch(pack([1.0, [event, {"type": "AllBlocksCleared"}]]))
    assert decoded.dropped == [reason]
    assert decoded.events == [AllBlocksCleared()]
    assert reason in REASONS


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        pytest.param(b"\xc1", "not-msgpack", id="reserved-byte"),
        pytest.param(b"", "not-msgpack", id="empty"),
        pytest.param(pack([1.0]), "bad-batch", id="short-array"),
        pytest.param(pack("x"), "bad-batch", id="string"),
        pytest.param(pack(["ts", []]), "bad-batch", id="ts-not-number"),
        pytest.param(pack([1.0, {}]), "bad-batch", id="events-not-array"),
        pytest.param(pack([1.0, [], "r"]), "bad-batch", id="rank-not-int"),
    ],
)
def test_a_payload_that_is_not_a_batch_raises_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_decode_error(payload: bytes) -> None:
    reason = None
    try:
        decode_batch(payload)
    except DecodeError as exc:
        reason = exc.reason
    assert reason is None or reason in REASONS


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(["type", *STORED_MAP]), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(MSGPACK_VALUES | st.just(STORED_ARRAY) | st.just(STORED_MAP), max_size=4))
def test_any_well_formed_msgpack_events_never_raise(events: list[Any]) -> None:
    decoded = decode_batch(pack([1.0, events, 0]))
    assert len(decoded.events) + len(decoded.dropped) == len(events)
    assert set(decoded.dropped) <= set(REASONS)


def _plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def real_messages() -> list[dict[str, Any]]:
    return list(json.loads((FIXTURES / "index.json").read_text()))


@pytest.mark.parametrize(
    "entry", real_messages(), ids=lambda e: f"seq{e['seq']}-{e['contains']}-{e['phase']}"
)
def test_real_vllm_batches_decode_to_what_the_recorder_saw(entry: dict[str, Any]) -> None:
    payload = (FIXTURES / entry["frames"][2]).read_bytes()
    decoded = decode_batch(payload)
    ts, raw_events, rank = _plain(entry["decoded"])
    assert (decoded.ts, decoded.data_parallel_rank, decoded.dropped) == (ts, rank, [])
    assert len(decoded.events) == len(raw_events)
    for event, raw in zip(decoded.events, raw_events, strict=True):
        assert type(event).__name__ == raw["type"]
        if isinstance(event, BlockStored):
            assert list(event.block_hashes) == raw["block_hashes"]
            assert event.parent_block_hash == raw["parent_block_hash"]
            assert list(event.token_ids) == raw["token_ids"]
            assert (event.block_size, event.medium, event.lora_name) == (
                raw["block_size"],
                raw["medium"],
                raw["lora_name"],
            )
        elif isinstance(event, BlockRemoved):
            assert (list(event.block_hashes), event.medium) == (raw["block_hashes"], raw["medium"])
