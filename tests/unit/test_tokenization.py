"""Token ids for routing: simulator, HuggingFace folder, the engine's /tokenize, fallbacks."""

from __future__ import annotations

import json
import socket
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
from servegate.tokenization.routing import RoutingTokenizers
from servegate.tokenization.settings import TokenizerSettings
from servegate.tokenization.sources import HFTokenizer, TokenizerError

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

MESSAGES = [
    {"role": "system", "content": "You answer questions about the cache."},
    {"role": "user", "content": "What is a prefix?"},
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] "
    "+ eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)


def chat(messages: list[dict[str, Any]] | None = None, **body: Any) -> LLMRequest:
    msgs = messages or MESSAGES
    return LLMRequest(
        "r",
        RequestKind.CHAT,
        "m",
        "m",
        "m",
        messages=msgs,
        body={"model": "m", "messages": msgs, **body},
    )


def completion(prompt: Any, **body: Any) -> LLMRequest:
    return LLMRequest(
        "r", RequestKind.COMPLETION, "m", "m", "m", body={"model": "m", "prompt": prompt, **body}
    )


async def prepared(tok: RoutingTokenizers, request: LLMRequest, *eps: EndpointState) -> Any:
    await tok.prepare(request, list(eps))
    return request.cache.get("token_ids")


# -- simulator source ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        pytest.param(chat(), sim.encode_chat(MESSAGES), id="chat"),
        pytest.param(
            chat(add_generation_prompt=False),
            sim.encode_chat(MESSAGES, add_generation_prompt=False),
            id="chat-no-generation-prompt",
        ),
        pytest.param(completion("the cache holds"), sim.encode("the cache holds"), id="text"),
        pytest.param(completion(["the cache"]), sim.encode("the cache"), id="one-text-list"),
        pytest.param(completion(["a", "b"]), None, id="two-prompts-no-ids"),
        pytest.param(chat([{"role": "wizard", "content": "x"}]), None, id="bad-role-no-ids"),
    ],
)
async def test_simulator_source_gives_the_simulators_ids(
    request_: LLMRequest, expected: list[int] | None
) -> None:
    tok = RoutingTokenizers(TokenizerSettings(source="simulator"))
    assert await prepared(tok, request_) == expected
    if expected is not None:
        assert request_.prompt_tokens == len(expected)


async def test_ids_already_in_the_request_are_kept() -> None:
    tok = RoutingTokenizers(TokenizerSettings(source="simulator"))
    r = completion("text")
    r.cache["token_ids"] = [1, 2, 3]
    assert await prepared(tok, r) == [1, 2, 3]


async def test_per_model_settings_override_the_pool_default() -> None:
    tok = RoutingTokenizers(
        TokenizerSettings(source="chars"), {"m": TokenizerSettings(source="simulator")}
    )
    assert await prepared(tok, completion("abc")) == sim.encode("abc")
    other = completion("abc")
    other.model = other.target_model = other.base_model = "other"
    assert await prepared(tok, other) is None


def test_chars_only_is_inactive() -> None:
    assert not RoutingTokenizers(TokenizerSettings(source="chars")).active
    assert not RoutingTokenizers().active


# -- HuggingFace folder ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    models, pre, trainers, processors = (
        tokenizers.models,
        tokenizers.pre_tokenizers,
        tokenizers.trainers,
        tokenizers.processors,
    )
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>"],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the cache holds the prefix of the prompt"] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    _ = trainers
    return folder


def test_hf_completion_gets_bos_and_chat_renders_the_template(hf_folder: Path) -> None:
    tok = HFTokenizer(str(hf_folder))
    raw = tokenizers.Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    bos = raw.token_to_id("<s>")
    assert tok.completion_ids("the cache", True) == raw.encode("the cache").ids
    assert tok.completion_ids("the cache", True)[0] == bos
    text = tok.render(MESSAGES, {})
    assert text == (
        "<s><|system|>\nYou answer questions about the cache.</s>\n"
        "<|user|>\nWhat is a prefix?</s>\n<|assistant|>\n"
    )
    ids = tok.chat_ids(MESSAGES, {})
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids.count(bos) == 1


@pytest.mark.parametrize(
    ("request_", "special"),
    [
        pytest.param(completion("the cache"), True, id="completion-default-bos"),
        pytest.param(completion("the cache", add_special_tokens=False), False, id="no-bos"),
        pytest.param(chat(), False, id="chat-default-no-extra-bos"),
    ],
)
async def test_hf_source_follows_vllms_special_token_rules(
    hf_folder: Path, request_: LLMRequest, special: bool
) -> None:
    routing = RoutingTokenizers(TokenizerSettings(source="hf", path=str(hf_folder)))
    raw = tokenizers.Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    ids = await prepared(routing, request_)
    if request_.kind is RequestKind.CHAT:
        text = HFTokenizer(str(hf_folder)).render(MESSAGES, {})
    else:
        text = "the cache"
    assert ids == raw.encode(text, add_special_tokens=special).ids


def test_hf_list_content_is_joined_like_vllm(hf_folder: Path) -> None:
    tok = HFTokenizer(str(hf_folder))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.render(parts, {}) == "<s><|user|>\na\nb</s>\n<|assistant|>\n"


async def test_hf_continue_final_message_gives_no_ids(hf_folder: Path) -> None:
    routing = RoutingTokenizers(TokenizerSettings(source="hf", path=str(hf_folder)))
    assert await prepared(routing, chat(continue_final_message=True)) is None


def test_hf_folder_without_tokenizer_json_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        HFTokenizer(str(tmp_path))


def test_hf_settings_need_a_path() -> None:
    with pytest.raises(ValueError, match="needs `path`"):
        TokenizerSettings(source="hf")


# -- the engine's /tokenize ----------------------------------------------------------------


@pytest.fixture
async def sim_endpoint() -> AsyncIterator[EndpointState]:
    async with SimCluster(1, base={"model": "m"}) as cluster:
        yield EndpointState(Endpoint(address=cluster[0].address, url=cluster[0].url))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def engine_tokenizers(session: aiohttp.ClientSession, **settings: Any) -> RoutingTokenizers:
    tok = RoutingTokenizers(TokenizerSettings(source="engine", **settings))
    tok.bind_session(session)
    return tok


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        pytest.param(chat(), sim.encode_chat(MESSAGES), id="chat"),
        pytest.param(completion("the cache holds"), sim.encode("the cache holds"), id="completion"),
    ],
)
async def test_engine_source_asks_the_replica_and_caches_the_answer(
    sim_endpoint: EndpointState,
    session: aiohttp.ClientSession,
    request_: LLMRequest,
    expected: list[int],
) -> None:
    tok = engine_tokenizers(session)
    assert await prepared(tok, request_, sim_endpoint) == expected
    again = chat() if request_.kind is RequestKind.CHAT else completion("the cache holds")
    assert await prepared(tok, again, sim_endpoint) == expected
    assert (tok.stats.engine_calls, tok.stats.engine_cache_hits) == (1, 1)


def closed_port_endpoint() -> EndpointState:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return EndpointState(Endpoint(address=f"127.0.0.1:{port}", url=f"http://127.0.0.1:{port}"))


@pytest.mark.parametrize(
    ("fallback", "expected"),
    [
        pytest.param("simulator", sim.encode("abc"), id="fallback-simulator"),
        pytest.param("chars", None, id="fallback-chars"),
    ],
)
async def test_engine_failure_falls_back(
    session: aiohttp.ClientSession, fallback: str, expected: list[int] | None
) -> None:
    tok = engine_tokenizers(session, fallback=fallback, timeout_s=1.0)
    assert await prepared(tok, completion("abc"), closed_port_endpoint()) == expected
    assert tok.stats.engine_failures == 1


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        pytest.param(500, {"error": "boom"}, id="status-500"),
        pytest.param(200, {"tokens": ["a"]}, id="tokens-not-ints"),
        pytest.param(200, {"count": 3}, id="no-tokens"),
        pytest.param(200, [1, 2], id="not-an-object"),
    ],
)
async def test_a_bad_tokenize_answer_falls_back(
    aiohttp_server: Any, session: aiohttp.ClientSession, status: int, answer: Any
) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    server = await aiohttp_server(app)
    ep = EndpointState(Endpoint(address=f"127.0.0.1:{server.port}", url=str(server.make_url(""))))
    tok = engine_tokenizers(session, fallback="simulator")
    assert await prepared(tok, completion("abc"), ep) == sim.encode("abc")
    assert (tok.stats.engine_calls, tok.stats.engine_failures) == (1, 1)


async def test_the_engine_cache_is_bounded(
    sim_endpoint: EndpointState, session: aiohttp.ClientSession
) -> None:
    tok = engine_tokenizers(session, cache_size=2)
    for text in ("one", "two", "three"):
        await prepared(tok, completion(text), sim_endpoint)
    engine = tok.for_request(completion("x"))
    assert engine is not None and len(engine.cache) == 2  # type: ignore[union-attr]
