"""`tokenizer: {source: auto}`, the default: discovered per model, prefix-cached, never blocking."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.simulator import tokenizer as sim
from servegate.testing.cluster import SimCluster
from servegate.tokenization import auto
from servegate.tokenization.routing import RoutingTokenizers
from servegate.tokenization.settings import TokenizerSettings
from servegate.tokenization.sources import HFTokenizer

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
    "river",
    "stone",
    "cloud",
    "field",
]
PREFIX = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(400))
"""~2,700 characters: five chunks."""


def completion(prompt: str, rid: str = "r") -> LLMRequest:
    return LLMRequest(
        rid, RequestKind.COMPLETION, "m", "m", "m", body={"model": "m", "prompt": prompt}
    )


def chat(messages: list[dict[str, Any]], rid: str = "r") -> LLMRequest:
    return LLMRequest(
        rid,
        RequestKind.CHAT,
        "m",
        "m",
        "m",
        messages=messages,
        body={"model": "m", "messages": messages},
    )


def model_tokenizer(tok: RoutingTokenizers) -> auto.ModelTokenizer:
    source = tok.for_request(completion("x"))
    assert isinstance(source, auto.AutoTokenizer)
    return source.for_model("m")


async def settle(tok: RoutingTokenizers) -> None:
    """Until the background tokenisations are done."""
    mt = model_tokenizer(tok)
    for _ in range(100):
        if not mt._background:
            return
        await asyncio.gather(*list(mt._background), return_exceptions=True)
    raise AssertionError("background tokenisation never settled")


async def ids_of(tok: RoutingTokenizers, request: LLMRequest, ep: EndpointState) -> Any:
    await tok.prepare(request, [ep])
    return request.cache.get("token_ids")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def sim_endpoint() -> AsyncIterator[EndpointState]:
    async with SimCluster(1, base={"model": "m"}) as cluster:
        yield EndpointState(Endpoint(address=cluster[0].address, url=cluster[0].url))


def auto_tokenizers(session: aiohttp.ClientSession, **settings: Any) -> RoutingTokenizers:
    tok = RoutingTokenizers(TokenizerSettings(**settings))
    tok.bind_session(session)
    return tok


# -- chunks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [PREFIX, "x" * 3000, PREFIX.replace(" ", "  "), "a " * 2000, "", "short text"],
    ids=["words", "no-spaces", "double-spaces", "one-letter-words", "empty", "short"],
)
def test_chunks_cut_only_before_a_single_space_and_a_letter(text: str) -> None:
    cuts = auto.chunk_cuts(text, 512)
    last = 0
    for cut in cuts:
        assert cut - last >= 512
        assert text[cut] == " " and not text[cut - 1].isspace() and text[cut + 1].isalpha()
        last = cut
    if len(text) > 1100 and " " in text.strip() and "  " not in text:
        assert cuts


# -- against the simulator's /tokenize -----------------------------------------------------


async def test_shared_prefix_is_tokenised_once_and_routed_without_waiting(
    sim_endpoint: EndpointState, session: aiohttp.ClientSession
) -> None:
    tok = auto_tokenizers(session)
    first = PREFIX + " question one: where is the river"
    assert await ids_of(tok, completion(first), sim_endpoint) == sim.encode(first)
    await settle(tok)
    mt = model_tokenizer(tok)
    assert mt.status.source == "engine"
    assert mt.status.verified == 1 and mt.status.mismatches == 0
    calls = tok.stats.engine_calls
    second = completion(PREFIX + " question two: what is the stone", "r2")
    ids = await ids_of(tok, second, sim_endpoint)
    # routed at once on the cached leading chunks: no call was awaited
    assert tok.stats.engine_calls == calls
    whole = sim.encode(second.body["prompt"])
    assert second.cache.get(auto.PARTIAL_KEY) is True
    assert len(ids) >= len(whole) - 200 and ids == whole[: len(ids)]
    assert second.prompt_tokens > len(ids)
    await settle(tok)
    # its own tail is cached now: the same prompt again is whole and exact, without a call
    calls = tok.stats.engine_calls
    again = completion(second.body["prompt"], "r3")
    assert await ids_of(tok, again, sim_endpoint) == whole
    assert tok.stats.engine_calls == calls and auto.PARTIAL_KEY not in again.cache


async def test_a_new_turn_is_routed_on_its_conversation_prefix(
    sim_endpoint: EndpointState, session: aiohttp.ClientSession
) -> None:
    tok = auto_tokenizers(session)
    system = {"role": "system", "content": PREFIX}
    turn1 = [system, {"role": "user", "content": "where is the river"}]
    assert await ids_of(tok, chat(turn1), sim_endpoint) == sim.encode_chat(turn1)
    await settle(tok)
    # another conversation with the same system prompt: the system part is cached
    other = [system, {"role": "user", "content": "what is the stone"}]
    request = chat(other, "r2")
    calls = tok.stats.engine_calls
    ids = await ids_of(tok, request, sim_endpoint)
    assert tok.stats.engine_calls == calls
    assert ids == sim.encode_chat([system], add_generation_prompt=False)
    assert ids == sim.encode_chat(other)[: len(ids)]
    await settle(tok)
    # the next turn of the first conversation: its whole first request is cached
    turn2 = [*turn1, {"role": "assistant", "content": "north"}, {"role": "user", "content": "ok"}]
    request = chat(turn2, "r3")
    ids = await ids_of(tok, request, sim_endpoint)
    assert ids == sim.encode_chat(turn1)
    assert ids == sim.encode_chat(turn2)[: len(ids)]
    assert model_tokenizer(tok).status.mismatches == 0


# -- replicas that cannot help ----------------------------------------------------------------


async def fake_engine(aiohttp_server: Any, tokenize: Any, models: Any = None) -> EndpointState:
    async def list_models(request: web.Request) -> web.Response:
        return web.json_response(models or {"data": [{"id": "m", "root": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    if tokenize is not None:
        app.router.add_post("/tokenize", tokenize)
    server = await aiohttp_server(app)
    return EndpointState(Endpoint(address=f"127.0.0.1:{server.port}", url=str(server.make_url(""))))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_replica_without_tokenize_means_character_blocks_said_once(
    aiohttp_server: Any, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    ep = await fake_engine(aiohttp_server, None)
    tok = auto_tokenizers(session)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            assert await ids_of(tok, completion(PREFIX, f"r{i}"), ep) is None
    assert model_tokenizer(tok).status.source == "chars"
    assert len(warnings(caplog)) == 1 and "'m'" in warnings(caplog)[0]
    assert tok.status()["m"]["source"] == "chars"


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        pytest.param(200, {"tokens": ["a", "b"]}, id="not-ids"),
        pytest.param(200, {"tokens": [-1]}, id="negative"),
        pytest.param(200, "garbage", id="not-an-object"),
        pytest.param(500, {"error": "boom"}, id="status-500"),
    ],
)
async def test_a_wrong_tokenize_answer_gives_no_ids_and_is_said_once(
    aiohttp_server: Any,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    status: int,
    answer: Any,
) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("prompt") == "hello world":  # the discovery probe works
            return web.json_response({"tokens": [1, 2]})
        return web.Response(text=json.dumps(answer), status=status)

    ep = await fake_engine(aiohttp_server, tokenize)
    tok = auto_tokenizers(session)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            assert await ids_of(tok, completion(f"prompt {i} " + "word " * 10, f"r{i}"), ep) is None
    mt = model_tokenizer(tok)
    assert mt.status.source == "engine" and mt.status.failures >= 3
    assert len(warnings(caplog)) == 1


async def test_a_slow_tokenize_never_blocks_routing_for_long(
    aiohttp_server: Any, session: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("prompt") != "hello world":
            await release.wait()
        return web.json_response({"tokens": [1, 2]})

    ep = await fake_engine(aiohttp_server, tokenize)
    tok = auto_tokenizers(session, timeout_s=0.2)
    for i in range(auto.BACKOFF_FAILURES):
        assert await ids_of(tok, completion(f"slow {i} words here", f"r{i}"), ep) is None
    calls = tok.stats.engine_calls
    # backed off: the next request does not wait for /tokenize at all
    assert await ids_of(tok, completion("another prompt here", "late"), ep) is None
    assert not model_tokenizer(tok).waiting_allowed()
    assert tok.stats.engine_calls == calls
    release.set()
    await settle(tok)


async def test_chunks_that_do_not_add_up_turn_prefix_caching_off(
    aiohttp_server: Any, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        text = (await request.json())["prompt"]
        # context-dependent ids: a chunk alone is not what it is inside the whole
        return web.json_response({"tokens": [len(text) % 97, *range(len(text.split()))]})

    ep = await fake_engine(aiohttp_server, tokenize)
    tok = auto_tokenizers(session)
    with caplog.at_level(logging.WARNING):
        await ids_of(tok, completion(PREFIX + " one"), ep)
        await settle(tok)
        mt = model_tokenizer(tok)
        assert mt.status.mismatches == 1 and not mt.status.chunking
        text = PREFIX + " two"
        request = completion(text, "r2")
        ids = await ids_of(tok, request, ep)
    assert ids == [len(text) % 97, *range(len(text.split()))]
    assert auto.PARTIAL_KEY not in request.cache
    assert len([w for w in warnings(caplog) if "prefix caching is off" in w]) == 1


# -- the model folder, when readable ---------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    folder = tmp_path_factory.mktemp("hf")
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([PREFIX] * 20, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
        "{% endfor %}"
    )
    return folder


async def test_a_readable_model_folder_is_used_locally(
    aiohttp_server: Any, session: aiohttp.ClientSession, hf_folder: Path
) -> None:
    async def no_tokenize(request: web.Request) -> web.Response:
        raise AssertionError("the engine was asked although the folder is readable")

    models = {"data": [{"id": "m", "root": str(hf_folder)}]}
    ep = await fake_engine(aiohttp_server, no_tokenize, models)
    tok = auto_tokenizers(session)
    local = HFTokenizer(str(hf_folder))
    for i, question in enumerate(["alpha river", "beta stone", "gamma cloud"]):
        text = f"{PREFIX} {question}"
        assert await ids_of(tok, completion(text, f"r{i}"), ep) == local.completion_ids(text, True)
    messages = [{"role": "user", "content": PREFIX}]
    assert await ids_of(tok, chat(messages), ep) == local.chat_ids(messages, {})
    mt = model_tokenizer(tok)
    assert mt.status.source == "hf" and mt.status.verified >= 3 and mt.status.mismatches == 0
    assert tok.stats.engine_cache_hits > 0


async def test_a_model_settled_without_ids_is_not_prepared_until_it_is_due_again(
    aiohttp_server: Any, session: aiohttp.ClientSession
) -> None:
    ep = await fake_engine(aiohttp_server, None)
    tok = auto_tokenizers(session)
    first = completion("first words", "r1")
    assert tok.needs_prepare(first)  # a model not seen yet: discovery runs
    assert await ids_of(tok, first, ep) is None
    await settle(tok)
    mt = model_tokenizer(tok)
    assert mt.status.source == "chars"
    # settled on no ids: the gateway skips the await, and `prepare` would have given none
    later = completion("more words", "r2")
    assert not tok.needs_prepare(later)
    assert await ids_of(tok, later, ep) is None
    assert mt._ready.is_set()
    # due to be asked again: prepared, and that starts the rediscovery
    mt._rediscover_at = 0.0
    again = completion("again words", "r3")
    assert tok.needs_prepare(again)
    await ids_of(tok, again, ep)
    await settle(tok)
    assert mt._rediscover_at > 0.0  # asked again, and due again later
    assert not tok.needs_prepare(completion("then", "r5"))
    # ids already there: nothing to prepare
    given = completion("given", "r4")
    given.cache["token_ids"] = [1, 2, 3]
    assert not tok.needs_prepare(given)


async def test_discovery_never_holds_routing_and_a_model_without_source_is_asked_again(
    aiohttp_server: Any, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    release = asyncio.Event()
    has_tokenize = False

    async def list_models(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"data": [{"id": "m", "root": "m"}]})

    async def tokenize(request: web.Request) -> web.Response:
        if not has_tokenize:
            return web.json_response({"error": "not yet"}, status=404)
        return web.json_response({"tokens": [7, 8, 9]})

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    server = await aiohttp_server(app)
    ep = EndpointState(Endpoint(address=f"127.0.0.1:{server.port}", url=str(server.make_url(""))))
    tok = auto_tokenizers(session)
    # /v1/models hangs: the first request routes without ids instead of waiting for it
    assert await ids_of(tok, completion("first words", "r1"), ep) is None
    mt = model_tokenizer(tok)
    assert mt.status.source == "pending"
    release.set()
    with caplog.at_level(logging.WARNING):
        await settle(tok)
        assert mt.status.source == "chars"  # no /tokenize yet
        assert await ids_of(tok, completion("more words", "r2"), ep) is None
    # later the replica answers /tokenize: the model is asked again and learns it
    has_tokenize = True
    mt._rediscover_at = 0.0
    await ids_of(tok, completion("again words", "r3"), ep)
    await settle(tok)
    assert mt.status.source == "engine"
    assert await ids_of(tok, completion("last words", "r4"), ep) == [7, 8, 9]
    assert len([r for r in caplog.records if "none (" in r.getMessage()]) == 1
