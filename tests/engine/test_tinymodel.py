"""The tiny model the engine tier serves: deterministic, cached, and shaped as vLLM expects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from servegate.testing.tinymodel import (
    TinyModel,
    TinyModelSpec,
    build_tiny_model,
    lora_tensor_shapes,
)

SMALL = TinyModelSpec(vocab_size=300, corpus_lines=200, adapters=("x",))


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "one", SMALL)
    second = build_tiny_model(tmp_path / "two", SMALL)
    assert first.root.name == second.root.name == SMALL.key()
    a, b = tree(first.root), tree(second.root)
    # adapter_config.json names its base model's folder, which differs per cache dir
    for files in (a, b):
        files.pop("adapters/x/adapter_config.json")
    assert a == b


def test_a_cached_build_is_reused(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path, SMALL)
    marker = first.model_dir / "config.json"
    stamp = marker.stat().st_mtime_ns
    again = build_tiny_model(tmp_path, SMALL)
    assert again == first
    assert marker.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ({}, True),
        ({"seed": 99}, False),
        ({"hidden_size": 128}, False),
        ({"adapters": ("y",)}, False),
    ],
    ids=["same-spec", "seed", "hidden-size", "adapters"],
)
def test_cache_key_follows_the_spec(change: dict[str, object], same: bool) -> None:
    other = dataclasses.replace(SMALL, **change)  # type: ignore[arg-type]
    assert (other.key() == SMALL.key()) is same


def test_default_model_matches_what_the_engine_tier_needs(tiny_model: TinyModel) -> None:
    config = json.loads((tiny_model.model_dir / "config.json").read_text())
    spec = tiny_model.spec
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    assert {k: config[k] for k in expected} == expected
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model.model_dir))
    assert config["vocab_size"] == len(tokenizer)
    ids = tokenizer("hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == config["bos_token_id"]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert sorted(tiny_model.adapters) == ["a1", "a2", "a3"]
    for folder in tiny_model.adapters.values():
        doc = json.loads((folder / "adapter_config.json").read_text())
        assert (doc["peft_type"], doc["r"], doc["target_modules"]) == (
            "LORA",
            spec.lora_rank,
            ["q_proj", "v_proj"],
        )
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        # q: A (8, 256), B (4 heads x 64 = 256, 8); v: A (8, 256), B (2 kv heads x 64 = 128, 8)
        assert shapes == lora_tensor_shapes(spec)
        assert shapes["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] == (128, 8)
