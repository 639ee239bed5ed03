"""deploy/triton: the example model repository is well formed and fits what servegate sends."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from servegate.config import load_config
from servegate.gateway.triton import TritonTranslator
from servegate.gateway.triton_tokens import TokenizerDir, ensemble_steps, tokenizer_dir

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "triton"
REPOSITORY = DEPLOY / "model_repository"
MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
TOKEN = re.compile(r'\s*(?:#[^\n]*\n|"((?:[^"\\]|\\.)*)"|([{}\[\]:,])|([^\s{}\[\]:,"#]+))')


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    text = text.rstrip() + "\n"
    while pos < len(text.rstrip()):
        match = TOKEN.match(text, pos)
        assert match is not None, f"cannot read protobuf text at {text[pos : pos + 40]!r}"
        pos = match.end()
        string, punct, word = match.groups()
        if string is not None:
            out.append(("str", string))
        elif punct is not None:
            out.append(("punct", punct))
        elif word is not None:
            out.append(("word", word))
    return out


def _value(tokens: list[tuple[str, str]], i: int) -> tuple[Any, int]:
    kind, text = tokens[i]
    if kind == "punct" and text == "{":
        return _message(tokens, i + 1, "}")
    if kind == "punct" and text == "[":
        items = []
        i += 1
        while tokens[i][1] != "]":
            item, i = _value(tokens, i)
            items.append(item)
            if tokens[i][1] == ",":
                i += 1
        return items, i + 1
    return text, i + 1


def _message(tokens: list[tuple[str, str]], i: int, end: str | None) -> tuple[dict[str, Any], int]:
    fields: dict[str, Any] = {}
    while i < len(tokens) and tokens[i][1] != end:
        kind, key = tokens[i]
        assert kind == "word", f"expected a field name, got {key!r}"
        i += 1
        if tokens[i][1] == ":":
            i += 1
        value, i = _value(tokens, i)
        fields.setdefault(key, []).append(value)
        if i < len(tokens) and tokens[i][1] == ",":
            i += 1
    return fields, i + 1


def parse_pbtxt(text: str) -> dict[str, Any]:
    fields, _ = _message(_tokens(text), 0, None)
    return fields


def config(model: str) -> dict[str, Any]:
    return parse_pbtxt((REPOSITORY / model / "config.pbtxt").read_text())


def tensor_names(cfg: dict[str, Any], kind: str) -> set[str]:
    return {t["name"][0] for t in cfg[kind][0]}


@pytest.mark.parametrize("model", MODELS)
def test_each_model_is_named_after_its_folder(model: str) -> None:
    cfg = config(model)
    assert cfg["name"] == [model]
    assert (REPOSITORY / model / "1").is_dir()
    for kind in ("input", "output"):
        for tensor in cfg[kind][0]:
            assert tensor["data_type"][0].startswith("TYPE_")


def test_ensemble_steps_use_real_tensors() -> None:
    ensemble = config("ensemble")
    ensemble_inputs = tensor_names(ensemble, "input")
    produced = set(ensemble_inputs)
    for step in ensemble["ensemble_scheduling"][0]["step"][0]:
        model = step["model_name"][0]
        target = config(model)
        for mapping in step.get("input_map", []):
            assert mapping["key"][0] in tensor_names(target, "input"), (model, mapping)
            assert mapping["value"][0] in produced, (model, mapping)
        for mapping in step.get("output_map", []):
            assert mapping["key"][0] in tensor_names(target, "output"), (model, mapping)
            produced.add(mapping["value"][0])
    assert tensor_names(ensemble, "output") <= produced
    assert config("tensorrt_llm")["model_transaction_policy"][0]["decoupled"] == ["true"]


def test_everything_servegate_sends_is_an_ensemble_input() -> None:
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 4,
        "stream": True,
        "stop": ["a"],
        "temperature": 0.1,
        "top_p": 0.5,
        "top_k": 3,
        "seed": 1,
        "presence_penalty": 0.1,
        "repetition_penalty": 1.1,
        "length_penalty": 1.0,
        "min_tokens": 1,
    }
    request = TritonTranslator().prepare("/v1/completions", orjson.dumps(body), "r")
    _, raw = request.call(load_config(DEPLOY / "servegate.yaml").pool.endpoints[0].to_endpoint("p"))
    assert set(orjson.loads(raw)) <= tensor_names(config("ensemble"), "input")


def test_servegate_config_is_valid() -> None:
    cfg = load_config(DEPLOY / "servegate.yaml")
    engines = {e.engine for e in cfg.pool.endpoints}
    assert engines == {"triton-tensorrt-llm", "vllm"}
    triton = cfg.pool.endpoints[0].to_endpoint(cfg.pool.name)
    assert triton.labels["servegate.io/triton-model"] == "ensemble"


def as_served(cfg: dict[str, Any]) -> dict[str, Any]:
    """The parts of Triton's `GET /v2/models/{m}/config` JSON that servegate reads: a map field
    (`parameters`) is an object keyed by `key`, a repeated message a list."""
    out: dict[str, Any] = {}
    parameters = {
        p["key"][0]: {"string_value": p["value"][0]["string_value"][0]}
        for p in cfg.get("parameters", [])
    }
    if parameters:
        out["parameters"] = parameters
    if "ensemble_scheduling" in cfg:
        steps = cfg["ensemble_scheduling"][0]["step"][0]
        out["ensemble_scheduling"] = {"step": [{"model_name": s["model_name"][0]} for s in steps]}
    return out


def test_the_example_repository_names_its_tokenizer_where_servegate_looks() -> None:
    steps = ensemble_steps(as_served(config("ensemble")))
    assert steps == ["preprocessing", "tensorrt_llm", "postprocessing"]
    found = tokenizer_dir(as_served(config("preprocessing")), "preprocessing")
    assert found == TokenizerDir("/models/llama-3-8b-instruct", False, "preprocessing")
    assert tokenizer_dir(as_served(config("ensemble")), "ensemble") is None
