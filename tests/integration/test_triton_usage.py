"""Triton's `usage` counted with the tokenizer its model configuration names, learned without
configuration and without a request waiting; characters / 4 (said once) when it cannot be."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.gateway import triton_tokens
from servegate.gateway.triton import MODEL_LABEL, TRITON_ENGINE
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.fake_triton import FakeTriton, processing_config, trtllm_repository
from tests.hf_folder import write_hf_folder
from tests.integration.conftest import MODEL, wait_for

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the router keeps each prefix on the replica that holds its cache blocks"] * 20
COMPLETION = "the replica holds the prefix blocks of the router cache"
PROMPT = "the router keeps a prefix on the replica"
ADMIN = {"Authorization": "Bearer admin-key"}
WARNING = f"Triton model {MODEL!r}: usage is estimated"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("trtllm") / "tokenizer", CORPUS)


def gateway_config(triton: FakeTriton) -> dict[str, Any]:
    return {
        "gateway": {"port": 0, "admin_keys": ["admin-key"]},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5},
            "endpoints": [
                {
                    "url": triton.url,
                    "engine": TRITON_ENGINE,
                    "model": MODEL,
                    "metrics_url": triton.url + "/metrics",
                    "labels": {MODEL_LABEL: "ensemble"},
                }
            ],
        },
    }


async def started(triton: FakeTriton) -> GatewayRunner:
    gw = GatewayRunner(gateway_config(triton))
    await gw.__aenter__()
    await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="a ready Triton endpoint")
    return gw


@pytest.fixture
async def learned(folder: Path) -> AsyncIterator[tuple[FakeTriton, GatewayRunner]]:
    async with FakeTriton(trtllm_repository(str(folder)), COMPLETION) as triton:
        gw = await started(triton)
        try:
            yield triton, gw
        finally:
            await gw.__aexit__(None, None, None)


def counts(gw: GatewayRunner) -> dict[str, Any]:
    status: dict[str, Any] = gw.gateway.default.state.triton_tokens.status()
    return status


async def complete(
    session: aiohttp.ClientSession, gw: GatewayRunner, chat: bool, stream: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(gw.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            usage: dict[str, Any] = (await resp.json())["usage"]
            return usage
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    last = orjson.loads(events[-2])
    assert last["choices"] == []
    usage = last["usage"]
    return usage


def estimate(text: str) -> int:
    return math.ceil(len(text) / triton_tokens.CHARS_PER_TOKEN)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_usage_is_the_tokenizers_exact_count(
    learned: tuple[FakeTriton, GatewayRunner],
    folder: Path,
    session: aiohttp.ClientSession,
    chat: bool,
    stream: bool,
) -> None:
    triton, gw = learned
    first = await complete(session, gw, chat, stream)
    assert first["token_count_source"] == "estimate"  # asked for the config, not waited for
    await wait_for(lambda: counts(gw).get(MODEL, {}).get("source") == "tokenizer", what="learned")
    usage = await complete(session, gw, chat, stream)
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    sent = triton.text_inputs[-1]
    # the preprocessing model's add_special_tokens is unset ("${...}"): TensorRT-LLM adds BOS
    prompt = len(raw.encode(sent, add_special_tokens=True).ids)
    completion = len(raw.encode(COMPLETION, add_special_tokens=False).ids)
    assert usage == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "token_count_source": "tokenizer",
    }
    assert (prompt, completion) != (estimate(sent), estimate(COMPLETION))
    assert triton.config_requests == {"ensemble": 1, "preprocessing": 1}


async def test_admin_and_metric_say_where_counts_come_from(
    learned: tuple[FakeTriton, GatewayRunner], folder: Path, session: aiohttp.ClientSession
) -> None:
    _, gw = learned
    await complete(session, gw, chat=False, stream=False)
    await wait_for(lambda: counts(gw).get(MODEL, {}).get("source") == "tokenizer", what="learned")
    async with session.get(gw.url + "/admin/pool", headers=ADMIN) as resp:
        signals = (await resp.json())["routing_signals"]
    assert signals["triton_token_count"] == {
        MODEL: {"source": "tokenizer", "detail": str(folder), "failures": 0}
    }
    assert await gauge(session, gw) == {"tokenizer": 1.0}


async def gauge(session: aiohttp.ClientSession, gw: GatewayRunner) -> dict[str, float]:
    async with session.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("servegate_routing_signal{") and 'signal="triton_token_count"' in line:
            assert f'model="{MODEL}"' in line
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


async def test_requests_never_wait_for_the_model_config(
    folder: Path, session: aiohttp.ClientSession
) -> None:
    async with FakeTriton(trtllm_repository(str(folder)), COMPLETION) as triton:
        triton.hold()
        gw = await started(triton)
        try:
            for chat in (False, True, False):
                usage = await complete(session, gw, chat, stream=False)
                assert usage["token_count_source"] == "estimate"
            assert triton.config_requests == {"ensemble": 1}
            assert counts(gw)[MODEL]["source"] == "pending"
            triton.release()
            await wait_for(lambda: counts(gw)[MODEL]["source"] == "tokenizer", what="learned")
            usage = await complete(session, gw, chat=False, stream=False)
            assert usage["token_count_source"] == "tokenizer"
        finally:
            await gw.__aexit__(None, None, None)


def broken(folder: Path) -> dict[str, dict[str, Any]]:
    missing = trtllm_repository(str(folder))
    del missing["preprocessing"]["parameters"]["tokenizer_dir"]
    del missing["postprocessing"]
    return {
        "404": {"ensemble": 404},
        "not-json": {"ensemble": b"<html>gateway timeout</html>"},
        "no-tokenizer-dir": missing,
        "unreadable-folder": trtllm_repository(str(folder / "not-there")),
        "unfilled-template": trtllm_repository("${tokenizer_dir}"),
    }


@pytest.mark.parametrize(
    "case", ["404", "not-json", "no-tokenizer-dir", "unreadable-folder", "unfilled-template"]
)
async def test_no_tokenizer_means_estimates_said_once_and_asked_again(
    folder: Path,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    monkeypatch.setattr(triton_tokens, "BACKOFF_FIRST_S", 0.02)
    async with FakeTriton(broken(folder)[case], COMPLETION) as triton:
        gw = await started(triton)
        try:
            with caplog.at_level(logging.WARNING, logger=triton_tokens.__name__):
                for _ in range(3):
                    usage = await complete(session, gw, chat=False, stream=False)
                    sent = triton.text_inputs[-1]
                    assert usage["token_count_source"] == "estimate"
                    assert usage["prompt_tokens"] == estimate(sent)
                    assert usage["completion_tokens"] == estimate(COMPLETION)
                    await wait_for(lambda: counts(gw)[MODEL]["source"] == "estimate", what="fail")
                for _ in range(100):  # a request after the back-off asks again
                    if counts(gw)[MODEL]["failures"] >= 2:
                        break
                    await asyncio.sleep(0.03)
                    await complete(session, gw, chat=False, stream=False)
            status = counts(gw)[MODEL]
            assert status["failures"] >= 2
            async with session.get(gw.url + "/admin/pool", headers=ADMIN) as resp:
                shown = (await resp.json())["routing_signals"]["triton_token_count"][MODEL]
            assert await gauge(session, gw) == {"estimate": 0.0}
        finally:
            await gw.__aexit__(None, None, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([w for w in warnings if w.startswith(WARNING)]) == 1
    assert triton.config_requests["ensemble"] >= 2
    assert shown["source"] == "estimate" and shown["detail"] == status["detail"] != ""


async def test_a_configured_tokenizer_counts_without_asking_triton(
    folder: Path, session: aiohttp.ClientSession
) -> None:
    repository = {"ensemble": 404, "preprocessing": processing_config("p", str(folder))}
    async with FakeTriton(repository, COMPLETION) as triton:
        cfg = gateway_config(triton)
        cfg["pool"]["tokenizer"] = {"source": "hf", "path": str(folder)}
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready")
            usage = await complete(session, gw, chat=False, stream=False)
            assert counts(gw) == {"*": {"source": "tokenizer", "detail": f"configured: {folder}"}}
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert usage["prompt_tokens"] == len(raw.encode(PROMPT, add_special_tokens=True).ids)
    assert triton.config_requests == {}


async def test_the_simulators_triton_persona_names_its_tokenizer(
    folder: Path, session: aiohttp.ClientSession
) -> None:
    sim = {"model": MODEL, "persona": TRITON_ENGINE, "speed": 200.0, "max_model_len": 2048,
           "tokenizer": {"path": str(folder)}, "output": {"mode": "echo"}}  # fmt: skip
    async with SimCluster(1, base=sim) as cluster:
        cfg = {
            "gateway": {"port": 0},
            "pool": {
                "scrape_interval_s": 0.05,
                "endpoints": [
                    {
                        "url": cluster[0].url,
                        "engine": TRITON_ENGINE,
                        "model": MODEL,
                        "metrics_url": cluster[0].metrics_url,
                    }
                ],
            },
        }
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready")
            await complete(session, gw, chat=True, stream=False)
            await wait_for(lambda: counts(gw)[MODEL]["source"] == "tokenizer", what="learned")
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7}
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                doc = await resp.json()
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    # the persona says add_special_tokens "false": it tokenises text_input as it is
    assert doc["usage"]["prompt_tokens"] == len(raw.encode(PROMPT, add_special_tokens=False).ids)
    text = doc["choices"][0]["text"]
    assert doc["usage"]["completion_tokens"] == len(raw.encode(text, add_special_tokens=False).ids)
    # echo mode generates the prompt's own tokens, which re-encode to themselves: the count
    # is also the engine's (7 generated, the whole max_tokens)
    assert doc["usage"]["completion_tokens"] == 7
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["token_count_source"] == "tokenizer"
