from __future__ import annotations

from typing import Any

import orjson
import pytest

from servegate.config import PoolSettings
from servegate.gateway.errors import BadRequest, ModelNotFound, UpstreamFailed
from servegate.gateway.triton import (
    ACCUMULATE_LABEL,
    MAX_TOKENS_LABEL,
    MODEL_LABEL,
    TokenCounter,
    TritonTranslator,
    UpstreamUnavailable,
    accumulates,
    completion_response,
    triton_error,
)
from servegate.gateway.triton_stream import TritonStream
from servegate.pool.endpoint import Endpoint

ENDPOINT = Endpoint(address="10.0.0.1:8000", url="http://10.0.0.1:8000", engine="triton")


def endpoint(**labels: str) -> Endpoint:
    return Endpoint(address="10.0.0.1:8000", url="http://10.0.0.1:8000", labels=labels)


def prepare(path: str = "/v1/completions", **body: Any) -> Any:
    doc = {"model": "m", **body}
    if path == "/v1/completions":
        doc.setdefault("prompt", "hi")
    return TritonTranslator().prepare(path, orjson.dumps(doc), "rid")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({}, {"text_input": "hi", "stream": False, "max_tokens": 16}, id="defaults"),
        pytest.param(
            {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3},
            {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "random_seed": 3},
            id="sampling",
        ),
        pytest.param(
            {"presence_penalty": 0.1, "frequency_penalty": 0.2, "min_tokens": 2},
            {"presence_penalty": 0.1, "frequency_penalty": 0.2, "min_length": 2},
            id="penalties",
        ),
        pytest.param({"stop": "END"}, {"stop_words": ["END"]}, id="stop-string"),
        pytest.param({"stop": ["a", ""]}, {"stop_words": ["a"]}, id="stop-list"),
        pytest.param({"max_completion_tokens": 9}, {"max_tokens": 9}, id="max-completion"),
        pytest.param({}, {"exclude_input_in_output": True}, id="exclude-input"),
    ],
)
def test_completion_body(body: dict[str, Any], expected: dict[str, Any]) -> None:
    path, raw = prepare(**body).call(ENDPOINT)
    assert path == "/v2/models/m/generate"
    sent = orjson.loads(raw)
    assert expected.items() <= sent.items()


def test_stream_path_model_label_and_chat_default_max_tokens() -> None:
    request = prepare(
        "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], stream=True
    )
    path, raw = request.call(endpoint(**{MODEL_LABEL: "ensemble", MAX_TOKENS_LABEL: "77"}))
    sent = orjson.loads(raw)
    assert path == "/v2/models/ensemble/generate_stream"
    assert (sent["stream"], sent["max_tokens"]) == (True, 77)
    assert "exclude_input_in_output" not in sent
    assert sent["text_input"] == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_model_names_with_slashes_are_quoted() -> None:
    path, _ = (
        TritonTranslator()
        .prepare("/v1/completions", b'{"model": "org/m", "prompt": "x"}', "r")
        .call(ENDPOINT)
    )
    assert path == "/v2/models/org%2Fm/generate"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"n": 2}, "n", id="n"),
        pytest.param({"logprobs": 1}, "logprobs", id="logprobs"),
        pytest.param({"echo": True}, "echo", id="echo"),
        pytest.param({"tools": [{"type": "function"}]}, "tools", id="tools"),
        pytest.param({"prompt": [1, 2]}, "prompt", id="token-ids"),
        pytest.param({"prompt": ["a", "b"]}, "prompt", id="two-prompts"),
        pytest.param({"temperature": "hot"}, "temperature", id="bad-number"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max"),
        pytest.param({"stop": 3}, "stop", id="bad-stop"),
        pytest.param({"response_format": {"type": "json_object"}}, "response_format", id="json"),
    ],
)
def test_refused_with_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        prepare(**body)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        pytest.param(b"{", "/v1/completions", id="not-json"),
        pytest.param(b"[]", "/v1/completions", id="not-object"),
        pytest.param(b'{"model": "m", "input": "x"}', "/v1/embeddings", id="embeddings"),
        pytest.param(b'{"model": "m", "messages": "x"}', "/v1/chat/completions", id="messages"),
        pytest.param(
            b'{"model": "m", "messages": [{"content": "x"}]}', "/v1/chat/completions", id="role"
        ),
    ],
)
def test_malformed_requests(raw: bytes, path: str) -> None:
    with pytest.raises(BadRequest):
        TritonTranslator().prepare(path, raw, "r")


@pytest.mark.parametrize(
    ("chat", "output", "max_tokens", "text", "finish"),
    [
        pytest.param(False, "hi there you", 5, " there you", "stop", id="prompt-stripped"),
        pytest.param(False, "abcdefgh", 2, "abcdefgh", "length", id="length"),
        pytest.param(True, "yes", 5, "yes", "stop", id="chat"),
    ],
)
def test_completion_response(
    chat: bool, output: str, max_tokens: int, text: str, finish: str
) -> None:
    if chat:
        request = prepare(
            "/v1/chat/completions", messages=[{"role": "user", "content": "q"}], max_tokens=5
        )
    else:
        request = prepare(max_tokens=max_tokens)
    data = orjson.dumps({"model_name": "m", "model_version": "1", "text_output": output})
    raw, usage = completion_response(request, ENDPOINT, data)
    doc = orjson.loads(raw)
    choice = doc["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == text
    assert choice["finish_reason"] == finish
    # estimate: ceil(chars / 4)
    assert doc["usage"]["completion_tokens"] == usage.completion_tokens == -(-len(text) // 4)
    assert doc["usage"]["token_count_source"] == "estimate"
    assert doc["id"] == ("chatcmpl-rid" if chat else "cmpl-rid")


@pytest.mark.parametrize(
    "data",
    [b"nope", b'{"model_name": "m"}', b'{"text_output": 3}'],
    ids=["bad-json", "no-text", "bad-text"],
)
def test_invalid_triton_answer_is_upstream_failure(data: bytes) -> None:
    with pytest.raises(UpstreamFailed):
        completion_response(prepare(), ENDPOINT, data)


@pytest.mark.parametrize(
    ("status", "body", "kind", "openai_status"),
    [
        pytest.param(400, b'{"error": "bad input"}', BadRequest, 400, id="400"),
        pytest.param(
            400,
            b'{"error": "Request for unknown model: \'x\' is not found"}',
            ModelNotFound,
            404,
            id="400-unknown-model",
        ),
        pytest.param(404, b'{"error": "gone"}', ModelNotFound, 404, id="404"),
        pytest.param(501, b'{"error": "unsupported"}', BadRequest, 400, id="501"),
        pytest.param(500, b'{"error": "boom"}', UpstreamFailed, 502, id="500"),
        pytest.param(503, b"", UpstreamUnavailable, 503, id="503-empty-body"),
    ],
)
def test_triton_error_mapping(status: int, body: bytes, kind: type, openai_status: int) -> None:
    exc = triton_error(status, body, ENDPOINT)
    assert isinstance(exc, kind)
    assert exc.status == openai_status
    assert exc.message


def events(out: bytes) -> list[Any]:
    parts = [p.removeprefix(b"data: ") for p in out.split(b"\n\n") if p]
    return [p.decode() if p == b"[DONE]" else orjson.loads(p) for p in parts]


def triton_events(*texts: str) -> bytes:
    return b"".join(b"data: " + orjson.dumps({"text_output": t}) + b"\n\n" for t in texts)


@pytest.mark.parametrize(
    ("accumulate", "texts"),
    [
        pytest.param(False, ("a ", "b ", "c"), id="incremental"),
        pytest.param(True, ("a ", "a b ", "a b c"), id="accumulated"),
    ],
)
def test_stream_deltas(accumulate: bool, texts: tuple[str, ...]) -> None:
    request = prepare(stream=True, max_tokens=10)
    stream = TritonStream(request, 10, accumulate)
    raw = triton_events(*texts)
    out = b"".join(stream.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) + stream.finish()
    got = events(out)
    assert got[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in got[:-1]] == ["a ", "b ", "c", ""]
    assert got[-2]["choices"][0]["finish_reason"] == "stop"
    assert stream.usage is not None and stream.usage.completion_tokens == 2  # ceil(5 / 4)


def test_chat_stream_role_first_and_usage_chunk() -> None:
    request = prepare(
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "q"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=1,
    )
    stream = TritonStream(request, 1)
    got = events(stream.feed(triton_events("", "hello")) + stream.finish())
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hello"}
    assert got[1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert got[2]["choices"] == [] and got[2]["usage"]["completion_tokens"] == 2
    assert got[3] == "[DONE]"
    assert all(c["usage"] is None for c in got[:2])


def test_stream_error_event_then_done_and_nothing_after() -> None:
    stream = TritonStream(prepare(stream=True), 16)
    out = stream.feed(triton_events("x") + b'data: {"error": "engine died"}\n\n')
    got = events(out)
    assert got[1]["error"]["code"] == "upstream_failed"
    assert "engine died" in got[1]["error"]["message"]
    assert got[-1] == "[DONE]"
    assert stream.error == "engine died" and stream.ended
    assert stream.feed(triton_events("y")) == b"" and stream.finish() == b""


def test_stream_last_event_without_blank_line() -> None:
    stream = TritonStream(prepare(stream=True), 16)
    out = stream.feed(b'data: {"text_output": "tail"}') + stream.finish()
    assert [e["choices"][0]["text"] for e in events(out)[:-1]] == ["tail", ""]


def test_stream_garbage_is_an_error() -> None:
    stream = TritonStream(prepare(stream=True), 16)
    got = events(stream.feed(b"data: {not json\n\n"))
    assert "not JSON" in got[0]["error"]["message"] and got[1] == "[DONE]"


def test_labels() -> None:
    assert accumulates(endpoint(**{ACCUMULATE_LABEL: "True"}))
    assert not accumulates(ENDPOINT)


def test_simulator_tokenizer_counts_from_pool_settings() -> None:
    pool = PoolSettings.model_validate(
        {"tokenizer": {"source": "simulator"}, "models": [{"id": "m", "chat_template": "{{ 1 }}"}]}
    )
    translator = TritonTranslator.from_pool(pool)
    assert translator.model("m").counter.source == "tokenizer"
    assert translator.model("other").counter.source == "tokenizer"
    request = translator.prepare(
        "/v1/chat/completions", b'{"model": "m", "messages": [{"role": "u", "content": "x"}]}', "r"
    )
    assert request.prompt == "1"


def test_estimate() -> None:
    assert [TokenCounter().count(t) for t in ("", "abc", "abcd", "abcde")] == [0, 1, 1, 2]
