"""The recorded real vLLM 0.32 bytes in tests/fixtures/real/ are what their index says.

`scripts/record_fixtures.py` wrote them from a real server. The KV-event messages are
decoded here with plain msgpack, independently of servegate's decoder (which has its
own tests over the same files), so a recording that is wrong fails here and not as a
decoder bug. The token ids and block hashes are checked against each other: the
cold prompt's blocks hold its first full blocks, the decode block continues that
chain, and eviction removes chains least recently used first, tail block first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from servegate.datalayer.health import parse_models
from servegate.pool.pool import ModelEntry
from servegate.simulator.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from servegate.simulator.kv_events import encode_event

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
EVENTS = REAL / "kv_events"
INDEX: list[dict[str, Any]] = json.loads((EVENTS / "index.json").read_text())
SOURCE: dict[str, Any] = json.loads((REAL / "SOURCE.json").read_text())
BLOCK = 32
FIELDS = {
    "BlockStored": [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ],
    "BlockRemoved": ["type", "block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": ["type"],
}  # fmt: skip
"""vLLM 0.32's msgspec structs, tagged by "type", fields in declaration order."""


def from_json(value: Any) -> Any:
    """index.json's form back to msgpack's: `{"hex": ...}` is bytes."""
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def frames(entry: dict[str, Any]) -> list[bytes]:
    return [(EVENTS / name).read_bytes() for name in entry["frames"]]


def events(entry: dict[str, Any]) -> list[dict[str, Any]]:
    batch = msgpack.unpackb(frames(entry)[2], raw=False)
    return list(batch[1])


def entry(phase: str, nth: int = 0) -> dict[str, Any]:
    return [e for e in INDEX if e["phase"] == phase][nth]


def stored(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in events(entry) if e["type"] == "BlockStored"]


def command_option(name: str) -> str:
    command = SOURCE["command"]
    return str(command[command.index(name) + 1])


def test_the_recording_covers_every_event_kind() -> None:
    phases = [e["phase"] for e in INDEX]
    assert phases == [
        "cold-prompt-then-decode",
        "cold-prompt-then-decode",
        "lora-a1-prompt",
        "eviction",
        "eviction",
        "reset-then-prompt",
    ]
    kinds = {event["type"] for e in INDEX for event in events(e)}
    assert kinds == set(FIELDS)
    assert SOURCE["vllm"] == "0.32.0"


@pytest.mark.parametrize("item", INDEX, ids=[f"{e['seq']:03d}-{e['phase']}" for e in INDEX])
def test_message_frames_are_as_indexed(item: dict[str, Any]) -> None:
    topic, seq, payload = frames(item)
    assert topic == item["topic"].encode()
    # 8-byte big-endian sequence number
    assert len(seq) == 8
    assert int.from_bytes(seq, "big", signed=True) == item["seq"]
    # 0x93: a msgpack array of 3, [ts, events, dp_rank]; events are maps
    assert payload[0] == 0x93
    batch = msgpack.unpackb(payload, raw=False)
    assert batch == from_json(item["decoded"])
    ts, batch_events, dp_rank = batch
    assert isinstance(ts, float)
    assert dp_rank == 0
    assert all(isinstance(e, dict) for e in batch_events)
    assert item["contains"] in {e["type"] for e in batch_events}


def test_one_topic_and_increasing_sequence_numbers_and_times() -> None:
    topics = {e["topic"] for e in INDEX}
    # vLLM publishes the topic it was given: kv@<host:port>@<served model name>
    assert topics == {f"kv@127.0.0.1:{command_option('--port')}@tiny"}
    seqs = [e["seq"] for e in INDEX]
    assert seqs == sorted(set(seqs))
    times = [e["decoded"][0] for e in INDEX]
    assert times == sorted(times)


@pytest.mark.parametrize("item", INDEX, ids=[f"{e['seq']:03d}-{e['phase']}" for e in INDEX])
def test_event_fields(item: dict[str, Any]) -> None:
    for event in events(item):
        assert list(event) == FIELDS[event["type"]]
        if event["type"] == "AllBlocksCleared":
            continue
        assert event["medium"] == "GPU"
        assert event["group_idx"] == 0
        hashes = event["block_hashes"]
        assert hashes
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        if event["type"] == "BlockStored":
            assert event["block_size"] == BLOCK
            assert len(event["token_ids"]) == BLOCK * len(hashes)
            assert len(event["extra_keys"]) == len(hashes)
            assert event["kv_cache_spec_kind"] == "full_attention"
            parent = event["parent_block_hash"]
            assert parent is None or 0 <= parent < 2**64


def test_cold_prompt_stores_its_full_blocks() -> None:
    item = entry("cold-prompt-then-decode")
    prompt = item["prompt_token_ids"]
    (event,) = stored(item)
    # 108 prompt tokens = 3 full blocks (96 tokens) + 12 in a partial block
    assert len(prompt) == 108
    assert event["token_ids"] == prompt[:96]
    assert event["parent_block_hash"] is None
    assert (event["lora_id"], event["lora_name"], event["extra_keys"]) == (None, None, [None] * 3)


def test_decode_fills_the_partial_block_and_continues_the_chain() -> None:
    first, second = entry("cold-prompt-then-decode", 0), entry("cold-prompt-then-decode", 1)
    (cold,) = stored(first)
    (decode,) = stored(second)
    assert decode["parent_block_hash"] == cold["block_hashes"][-1]
    # the 4th block: the prompt's last 12 tokens, then 20 generated ones
    assert decode["token_ids"][:12] == first["prompt_token_ids"][96:]
    assert len(decode["block_hashes"]) == 1


def test_adapter_blocks_name_the_adapter() -> None:
    item = entry("lora-a1-prompt")
    (event,) = stored(item)
    # 79 prompt tokens = 2 full blocks
    assert event["token_ids"] == item["prompt_token_ids"][:64]
    assert (event["lora_name"], event["extra_keys"]) == ("a1", [["a1"], ["a1"]])
    assert isinstance(event["lora_id"], int)
    assert event["parent_block_hash"] is None


def test_eviction_is_least_recently_used_and_tail_first() -> None:
    """The first chains stored are the first evicted, each from its last block back."""
    (cold,) = stored(entry("cold-prompt-then-decode", 0))
    (decode,) = stored(entry("cold-prompt-then-decode", 1))
    (adapter,) = stored(entry("lora-a1-prompt"))
    batch = events(entry("eviction"))
    kinds = [e["type"] for e in batch]
    # the new prompt's allocation evicts first, then its blocks are stored
    assert kinds == ["BlockRemoved"] * (len(kinds) - 1) + ["BlockStored"]
    removed = [h for e in batch[:-1] for h in e["block_hashes"]]
    assert all(len(e["block_hashes"]) == 1 for e in batch[:-1])
    chain = cold["block_hashes"] + decode["block_hashes"]
    assert removed[:6] == chain[::-1] + adapter["block_hashes"][::-1]
    assert not set(removed) & set(batch[-1]["block_hashes"])


def test_reset_clears_then_the_next_prompt_stores() -> None:
    item = entry("reset-then-prompt")
    cleared, event = events(item)
    assert cleared == {"type": "AllBlocksCleared"}
    # 53 prompt tokens = 1 full block
    assert event["token_ids"] == item["prompt_token_ids"][:32]
    assert event["parent_block_hash"] is None


def test_metrics_and_models_come_from_the_recorded_server() -> None:
    signals = json.loads((REAL / "vllm_metrics.json").read_text())
    for page in ("vllm_metrics.txt", "vllm_metrics_idle.txt"):
        assert signals[page]["block_size"] == int(command_option("--block-size"))
        assert signals[page]["num_blocks"] == int(command_option("--num-gpu-blocks-override"))
        assert signals[page]["lora"]["max_lora"] == int(command_option("--max-loras"))


def test_v1_models_parse_into_base_and_adapters() -> None:
    entries = parse_models((REAL / "v1_models.json").read_bytes())
    assert set(entries) == {
        ModelEntry("tiny", None),
        ModelEntry("a1", "tiny"),
        ModelEntry("a2", "tiny"),
        ModelEntry("a3", "tiny"),
    }


@pytest.mark.parametrize(
    "event",
    [
        BlockStored([1, 2], None, list(range(64)), BLOCK, None, "GPU", None),
        BlockRemoved([1], "GPU"),
        AllBlocksCleared(),
    ],
    ids=["stored", "removed", "cleared"],
)
def test_simulator_map_events_are_a_prefix_of_vllms_fields(event: KVEvent) -> None:
    """The simulator sends vLLM's fields in vLLM's order, but not 0.32's additions
    (`extra_keys`, `group_idx`, `kv_cache_spec_kind`): a decoder must not need them."""
    encoded = encode_event(event, "map")
    fields = FIELDS[encoded["type"]]
    assert list(encoded) == fields[: len(encoded)]
    assert set(fields[len(encoded) :]) <= {"extra_keys", "group_idx", "kv_cache_spec_kind"}
