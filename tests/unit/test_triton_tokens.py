"""Reading Triton's model configuration for a tokenizer, and the back-off when it has none."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tests.fake_triton import FakeTriton, ensemble_config, processing_config, trtllm_repository
from tests.hf_folder import write_hf_folder

from servegate.gateway import triton_tokens
from servegate.gateway.triton_tokens import (
    ModelCount,
    TokenizerDir,
    TritonConfigError,
    TritonTokenCounts,
    ensemble_steps,
    find_tokenizer_dir,
    tokenizer_dir,
)


def params(**values: str) -> dict[str, Any]:
    return {"parameters": {k: {"string_value": v} for k, v in values.items()}}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(params(tokenizer_dir="/t"), TokenizerDir("/t", True, "m"), id="default-true"),
        pytest.param(
            params(tokenizer_dir="/t", add_special_tokens="False"),
            TokenizerDir("/t", False, "m"),
            id="false",
        ),
        pytest.param(
            params(tokenizer_dir="/t", add_special_tokens="no"),
            TokenizerDir("/t", False, "m"),
            id="no",
        ),
        pytest.param(
            params(tokenizer_dir="/t", add_special_tokens="${add_special_tokens}"),
            TokenizerDir("/t", True, "m"),
            id="unfilled-is-true",
        ),
        pytest.param(
            params(tokenizer_dir="/t", add_special_tokens="maybe"),
            TokenizerDir("/t", True, "m"),
            id="unreadable-is-true",  # TensorRT-LLM's preprocessing warns and adds them
        ),
        pytest.param(params(tokenizer_dir="${tokenizer_dir}"), None, id="unfilled-dir"),
        pytest.param(params(tokenizer_dir=""), None, id="empty-dir"),
        pytest.param({"parameters": {"tokenizer_dir": "/t"}}, None, id="not-a-parameter"),
        pytest.param({}, None, id="none"),
    ],
)
def test_tokenizer_dir(config: dict[str, Any], expected: TokenizerDir | None) -> None:
    assert tokenizer_dir(config, "m") == expected


def test_ensemble_steps_in_order() -> None:
    assert ensemble_steps(ensemble_config()) == ["preprocessing", "tensorrt_llm", "postprocessing"]
    assert ensemble_steps({"ensemble_scheduling": {"step": "x"}}) == []
    assert ensemble_steps(processing_config("preprocessing", "/t")) == []


@pytest.mark.parametrize(
    ("asked", "repository", "expected"),
    [
        pytest.param("ensemble", trtllm_repository("/t"), ("/t", "preprocessing"), id="ensemble"),
        pytest.param(
            "tensorrt_llm_bls",
            {
                "tensorrt_llm_bls": {"backend": "python", "parameters": {}},
                "preprocessing": processing_config("preprocessing", "/t"),
            },
            ("/t", "preprocessing"),
            id="bls-calls-preprocessing",
        ),
        pytest.param(
            "custom",
            {"custom": processing_config("custom", "/own")},
            ("/own", "custom"),
            id="the-model-itself",
        ),
    ],
)
async def test_find_tokenizer_dir(
    asked: str, repository: dict[str, Any], expected: tuple[str, str]
) -> None:
    async with FakeTriton(repository, "") as triton, aiohttp.ClientSession() as session:
        found = await find_tokenizer_dir(session, triton.url, asked)
    assert (found.path, found.model) == expected


async def test_an_ensemble_step_without_a_config_is_an_error() -> None:
    repository = trtllm_repository("/t")
    repository["preprocessing"] = 500
    async with FakeTriton(repository, "") as triton, aiohttp.ClientSession() as session:
        with pytest.raises(TritonConfigError, match="preprocessing/config answered 500"):
            await find_tokenizer_dir(session, triton.url, "ensemble")


def test_back_off_doubles_from_5_to_300_s() -> None:
    counts = TritonTokenCounts(clock=lambda: 1000.0)
    entry = ModelCount()
    delays = []
    for _ in range(9):
        counts._failed("m", entry, "no config")
        delays.append(entry.retry_at - 1000.0)
    # 5 * 2**(n-1) for n = 1..9, capped at 300
    assert delays == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]


async def test_add_special_tokens_false_counts_no_bos(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    folder = write_hf_folder(tmp_path / "tok", ["alpha beta gamma delta"] * 10)
    repository = trtllm_repository(str(folder), add_special_tokens="false")
    async with FakeTriton(repository, "") as triton, aiohttp.ClientSession() as session:
        counts = TritonTokenCounts()
        counts.bind_session(session)
        assert counts.counter("m", triton.url, "ensemble") is None
        task = counts.models["m"].task
        assert task is not None
        await task
        counter = counts.counter("m", triton.url, "ensemble")
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert counter is not None
    text = "alpha gamma"
    assert counter.count_prompt(text, chat=False) == len(raw.encode(text).ids) - 1
    assert counter.count_prompt(text, chat=True) == len(raw.encode(text).ids) - 1


async def test_one_learning_at_a_time_and_close_cancels_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with FakeTriton(trtllm_repository("/t"), "") as triton, aiohttp.ClientSession() as s:
        triton.hold()
        counts = TritonTokenCounts()
        counts.bind_session(s)
        for _ in range(5):
            assert counts.counter("m", triton.url, "ensemble") is None
            await asyncio.sleep(0.01)
        assert triton.config_requests == {"ensemble": 1}
        with caplog.at_level(logging.WARNING):
            await counts.close()
    assert counts.models["m"].task is None
    assert counts.status() == {"m": {"source": "pending", "detail": "", "failures": 0}}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_models_beyond_the_bound_are_estimated_untracked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(triton_tokens, "MAX_MODELS", 2)
    async with FakeTriton({}, "") as triton, aiohttp.ClientSession() as session:
        counts = TritonTokenCounts()
        counts.bind_session(session)
        for name in ("a", "b", "c"):
            assert counts.counter(name, triton.url, name) is None
        await counts.close()
    assert sorted(counts.models) == ["a", "b"]
