"""The /metrics page of every persona, checked against real engine output and parsers."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servegate.simulator.config import parse_sim_config
from servegate.simulator.engine import Engine
from servegate.simulator.metrics import build_registry, render, trtllm_iteration_stats
from servegate.simulator.tokenizer import BuiltinTokenizer

# Captured from real vLLM 0.32 on CPU (shared/PROTOCOLS.md section 1).
REAL_VLLM = """\
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 12.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters="a1"} \
1.795941900477396e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} \
1.795941900568228e+09
"""


def engine_for(**changes: Any) -> Engine:
    data: dict[str, Any] = {"model": "tiny", "num_blocks": 33, "block_size": 4, "max_model_len": 64}
    data.update(changes)
    return Engine(parse_sim_config(data), BuiltinTokenizer())


def samples(page: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def page_of(engine: Engine) -> str:
    return render(build_registry(engine)).decode()


def busy_engine(**changes: Any) -> Engine:
    engine = engine_for(**changes)
    engine.submit(list(range(10, 30)), request_id="a", max_tokens=3)
    while engine.num_running or engine.num_waiting:
        engine.step_now()
    engine.submit(list(range(10, 30)), request_id="b", max_tokens=30)
    engine.submit(list(range(500, 510)), request_id="c", max_tokens=30)
    engine.step_now()
    return engine


def test_vllm_families_and_label_keys_match_real_vllm() -> None:
    ours = samples(page_of(engine_for(lora={"adapters": ["a1"], "max_loras": 2})))
    for name, series in samples(REAL_VLLM).items():
        assert name in ours, name
        expected_keys = {frozenset(labels) for labels, _ in series}
        assert expected_keys <= {frozenset(labels) for labels, _ in ours[name]} or name == (
            "vllm:lora_requests_info"
        )
    assert {frozenset(labels) for labels, _ in ours["vllm:num_requests_running"]} == {
        frozenset({"engine", "model_name"})
    }


@pytest.mark.parametrize(
    "name",
    [
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:cache_config_info",
    ],
)
def test_vllm_page_has_family(name: str) -> None:
    assert name in samples(page_of(engine_for()))


def test_vllm_values_follow_the_engine() -> None:
    engine = busy_engine()
    got = samples(page_of(engine))

    def value(name: str) -> float:
        ((_, v),) = got[name]
        return v

    assert value("vllm:num_requests_running") == 2
    assert value("vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(engine.kv.usage)
    # queries: a 20 + b 20 + c 10; hits: b reuses (20 - 1) // 4 = 4 blocks = 16 tokens
    assert value("vllm:prefix_cache_queries_total") == 50
    assert value("vllm:prefix_cache_hits_total") == 16
    assert value("vllm:generation_tokens_total") == 3 + 1 + 1
    ((info, one),) = got["vllm:cache_config_info"]
    assert (info["block_size"], info["num_gpu_blocks"], info["enable_prefix_caching"], one) == (
        "4",
        "33",
        "True",
        1.0,
    )
    success = {labels["finished_reason"]: v for labels, v in got["vllm:request_success_total"]}
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 0}


def test_lora_requests_info_keeps_one_series_per_state() -> None:
    engine = engine_for(lora={"adapters": ["a1", "a2"], "max_loras": 1})
    assert engine.lora is not None
    engine.submit(list(range(8)), request_id="1", max_tokens=2, lora=engine.lora.get("a1"))
    engine.submit(list(range(100, 108)), request_id="2", max_tokens=2, lora=engine.lora.get("a2"))
    for _ in range(6):
        engine.step_now()
    series = samples(page_of(engine))["vllm:lora_requests_info"]
    states = [
        (s["running_lora_adapters"], s["waiting_lora_adapters"], s["max_lora"]) for s, _ in series
    ]
    assert ("a1", "a2", "1") in states
    newest = max(series, key=lambda item: item[1])[0]
    assert (newest["running_lora_adapters"], newest["waiting_lora_adapters"]) == ("", "")


@pytest.mark.parametrize(
    ("persona", "running", "waiting", "usage", "block"),
    [
        pytest.param(
            "sglang",
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:page_size",
            id="sglang",
        ),
        pytest.param(
            "trtllm-serve",
            "trtllm_num_requests_running",
            "trtllm_num_requests_waiting",
            "trtllm_kv_cache_utilization",
            "trtllm_kv_cache_tokens_per_block",
            id="trtllm",
        ),
    ],
)
def test_other_personas(persona: str, running: str, waiting: str, usage: str, block: str) -> None:
    engine = busy_engine(persona=persona)
    got = samples(page_of(engine))
    assert got[running][0][1] == 2
    assert got[waiting][0][1] == 0
    assert got[usage][0][1] == pytest.approx(engine.kv.usage)
    assert got[block][0][1] == 4
    assert not any(name.startswith("vllm:") for name in got)


def test_triton_series() -> None:
    engine = busy_engine(persona="triton-tensorrt-llm")
    got = samples(page_of(engine))
    requests = {s["request_type"]: v for s, v in got["nv_trt_llm_request_metrics"]}
    blocks = {s["kv_cache_block_type"]: v for s, v in got["nv_trt_llm_kv_cache_block_metrics"]}
    assert (requests["scheduled"], requests["waiting"]) == (2, 0)
    # 33 blocks, 1 reserved: max 32
    assert (blocks["max"], blocks["tokens_per"]) == (32, 4)
    assert blocks["used"] / blocks["max"] == pytest.approx(blocks["fraction"])
    labels, _ = got["nv_trt_llm_request_metrics"][0]
    assert (labels["model"], labels["version"]) == ("tiny", "1")


def test_trtllm_json_iteration_stats() -> None:
    engine = busy_engine(persona="trtllm-serve")
    (stats,) = trtllm_iteration_stats(engine)
    kv = stats["kvCacheStats"]
    assert isinstance(kv, dict)
    assert (stats["numActiveRequests"], kv["maxNumBlocks"], kv["tokensPerBlock"]) == (2, 32, 4)


@pytest.mark.parametrize("persona", ["vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"])
def test_servegate_parser_reads_every_persona(persona: str) -> None:
    try:
        parser_mod = importlib.import_module("servegate.datalayer.metrics_parser")
        registry_mod = importlib.import_module("servegate.engines.registry")
    except ImportError:
        pytest.skip("servegate's metrics parser is not available")
    engine = busy_engine(persona=persona, lora={"adapters": ["a1"], "max_loras": 2})
    spec = registry_mod.builtin_engines()[persona]
    result = parser_mod.MetricsParser(spec).parse(page_of(engine), 1.0)
    m = result.metrics
    assert (m.running, m.waiting) == (2, 0)
    assert m.kv_usage == pytest.approx(engine.kv.usage)
    assert m.block_size == 4
    if persona == "vllm":
        assert m.num_blocks == 33
        assert m.lora is not None and m.lora.max_lora == 2
        assert (m.prefix_cache_queries, m.prefix_cache_hits) == (50, 16)
