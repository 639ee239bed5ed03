"""The standard comparison at a tiny size: real simulator and gateway processes."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
from typer.testing import CliRunner

from servegate.bench.policies import Policy, policy_named
from servegate.bench.standard import (
    DOCS_PLOT,
    DOCS_SWEEP,
    SECTION,
    StandardResult,
    StandardSpec,
    comparison_table,
    run_standard,
    standard_command,
    verdict_lines,
    write_outputs,
)
from servegate.config import parse_config
from servegate.simulator.config import SimConfigError

TINY = StandardSpec(
    replicas=2,
    num_blocks=64,
    max_model_len=512,
    max_num_seqs=8,
    speed=20.0,
    groups=2,
    prompts_per_group=4,
    system_prompt_len=40,
    question_len=8,
    output_len=4,
    concurrency=(1, 2),
    rounds=2,
    timeout_s=20.0,
)
FUTURE = Policy("future", (("no-such-scorer", 1.0),))
DOCS_BEFORE = "# Benchmarks\n\n## Other\n\nhand-written, kept\n"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[StandardResult, Path]:
    out = tmp_path_factory.mktemp("standard")
    policies = [policy_named("round-robin"), policy_named("approx-prefix"), FUTURE]
    result = asyncio.run(run_standard(TINY, out / "results", policies=policies))
    docs = out / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(DOCS_BEFORE)
    write_outputs(result, out / "results", "make bench", docs)
    return result, out


def test_only_registered_policies_run_and_the_others_say_why(
    ran: tuple[StandardResult, Path],
) -> None:
    result, _ = ran
    assert [p.name for p in result.policies] == ["round-robin", "approx-prefix"]
    # one summary per policy and load point (the sweep over concurrency 1 and 2)
    assert [(s.load, s.target) for s in result.summaries] == [
        ("c=1", "round-robin"),
        ("c=1", "approx-prefix"),
        ("c=2", "round-robin"),
        ("c=2", "approx-prefix"),
    ]
    assert result.unavailable == {
        "future": "plugin type `no-such-scorer` is not registered in this build"
    }


def test_every_policy_gets_the_whole_workload_and_the_replicas_count_exactly_it(
    ran: tuple[StandardResult, Path],
) -> None:
    result, _ = ran
    # 2 groups x 4 questions = 8 requests per policy; warm-up requests fall outside
    # the counter reads, so the replicas' request counters add up to exactly 8.
    for summary in result.summaries:
        assert (summary.requests, summary.errors) == (8, 0)
        assert summary.balance_source == "engine"
        assert summary.hit_rate_source == "engine"
        assert sum(summary.replica_requests.values()) == 8
    assert all(run.cache_resets_failed == 0 for run in result.runs)


def test_engine_hit_rate_matches_what_the_responses_report(
    ran: tuple[StandardResult, Path],
) -> None:
    result, _ = ran
    for run, summary in zip(result.runs, result.summaries, strict=True):
        cached = sum(r.cached_tokens or 0 for r in run.results)
        prompt = sum(r.prompt_tokens or 0 for r in run.results)
        assert summary.hit_rate == pytest.approx(cached / prompt)


def test_round_robin_spreads_requests_evenly(ran: tuple[StandardResult, Path]) -> None:
    result, _ = ran
    # Each round of 4 requests alternates over the 2 replicas: 2 + 2, twice.
    assert sorted(result.summaries[0].replica_requests.values()) == [4.0, 4.0]
    assert result.summaries[0].balance == 1.0


def test_outputs_reports_configs_and_the_docs_section(ran: tuple[StandardResult, Path]) -> None:
    result, out = ran
    results = out / "results"
    for name in (
        "summary.json",
        "summary.csv",
        "requests.csv",
        "report.md",
        "ttft_cdf.png",
        "sweep.png",
    ):
        assert (results / name).stat().st_size > 0, name
    assert (results / "gateways" / "round-robin.yaml").exists()
    meta = orjson.loads((results / "summary.json").read_bytes())["meta"]
    assert meta["unavailable"] == result.unavailable
    assert set(meta["policies"]) == {"round-robin", "approx-prefix"}
    docs = (out / "docs" / "benchmarks.md").read_text()
    assert docs.startswith(DOCS_BEFORE)
    assert f"<!-- {SECTION}:start -->" in docs and f"<!-- {SECTION}:end -->" in docs
    assert comparison_table(result) in docs
    assert "| `future` | not available |" in docs
    assert f"![TTFT CDF per policy]({DOCS_PLOT})" in docs
    assert (out / "docs" / DOCS_PLOT).read_bytes() == (results / "ttft_cdf.png").read_bytes()
    assert f"]({DOCS_SWEEP})" in docs
    assert (out / "docs" / DOCS_SWEEP).read_bytes() == (results / "sweep.png").read_bytes()


def test_ratios_carry_intervals_and_small_samples_are_flagged(
    ran: tuple[StandardResult, Path],
) -> None:
    result, out = ran
    lines = verdict_lines(result)
    ratios = [line for line in lines if not line.startswith("warning:")]
    assert [line.split(":")[0] for line in ratios] == [
        "[c=1] approx-prefix vs round-robin",
        "[c=2] approx-prefix vs round-robin",
    ]
    # two rounds each: a ratio with two usable rounds has an interval, e.g.
    # "TTFT p50 0.66× [0.05, 9.1]"; a round where round-robin hit nothing has no ratio
    interval = re.compile(r"TTFT p50 [0-9.]+× \[[0-9.e+-]+, [0-9.e+-]+\]")
    assert all(interval.search(line) for line in ratios), ratios
    # 4 requests per round cannot separate much, and the report says so
    assert any("a round has only 4 successful requests" in line for line in lines)
    docs = (out / "docs" / "benchmarks.md").read_text()
    assert all(line in docs for line in lines)
    document = orjson.loads((out / "results" / "summary.json").read_bytes())
    assert {r["metric"] for r in document["ratios"]} >= {"hit rate", "TTFT p50", "throughput"}
    assert all(r["base"] == "round-robin" for r in document["ratios"])
    assert all(r["rounds"] == 2 for r in document["ratios"] if r["metric"] == "TTFT p50")


def test_rewriting_the_docs_keeps_one_section(ran: tuple[StandardResult, Path]) -> None:
    result, out = ran
    docs = out / "docs" / "benchmarks.md"
    write_outputs(result, out / "again", "make bench", docs)
    assert docs.read_text().count(f"<!-- {SECTION}:start -->") == 1


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        pytest.param({"replicas": 0}, ValueError, id="no-replicas"),
        pytest.param({"speed": 0.0}, ValueError, id="speed-zero"),
        pytest.param({"num_blocks": 8}, SimConfigError, id="cache-below-max-model-len"),
    ],
)
def test_spec_rejects_sizes_that_cannot_run(changes: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        replace(TINY, **changes)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(standard_command)
    return app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--policy", "fastest"], "unknown policy 'fastest'", id="unknown-policy"),
        pytest.param(["--replicas", "0"], "replicas must be > 0", id="no-replicas"),
    ],
)
def test_command_rejects_bad_options_before_starting_anything(
    args: list[str], message: str
) -> None:
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("policy", "kv_events", "tokenizer"),
    [
        pytest.param("round-robin", [None, None], None, id="round-robin-no-events"),
        pytest.param(
            "exact-prefix",
            ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"],
            {"source": "simulator"},
            id="exact-subscribes-and-tokenizes",
        ),
    ],
)
def test_gateway_config_wires_kv_events_and_tokenizer_only_for_the_exact_policy(
    policy: str, kv_events: list[str | None], tokenizer: dict[str, str] | None
) -> None:
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    events = ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]
    config = TINY.gateway_config(policy_named(policy), urls, events)
    endpoints = config["pool"]["endpoints"]
    assert [e["url"] for e in endpoints] == urls
    assert [e.get("kv_events") for e in endpoints] == kv_events
    assert config["pool"].get("tokenizer") == tokenizer
    assert config["picker"] == policy_named(policy).picker_config
    assert (config["gateway"]["port"], config["log_level"]) == (0, "info")
    parse_config("", "<standard>", environ={}, overrides=config)  # the gateway accepts it
