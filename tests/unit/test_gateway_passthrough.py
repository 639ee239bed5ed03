"""Parsing the bodies of the passthrough routes, and the relay's reading of their answers."""

from __future__ import annotations

import orjson
import pytest

from servegate.gateway.errors import BadRequest
from servegate.gateway.headers import model_rewrite_of, subset_of, within_subset
from servegate.gateway.parse import body_text, form_fields, parse_request, with_model
from servegate.gateway.proxy import _is_error_object, usage_from
from servegate.scheduling.request import RequestKind
from servegate.testing.endpoints import endpoint_state

BOUNDARY = "b0und"
FORM_TYPE = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def form(fields: list[tuple[str, bytes, str | None]]) -> bytes:
    out = b""
    for name, data, filename in fields:
        disposition = f'form-data; name="{name}"'
        if filename:
            disposition += f'; filename="{filename}"'
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize(
    ("body", "text"),
    [
        pytest.param(
            {"instructions": "be kind", "input": [{"role": "user", "content": "hi"}]},
            "be kind\nhi",
            id="responses",
        ),
        pytest.param(
            {
                "system": [{"type": "text", "text": "sys"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
            },
            "sys\nq",
            id="anthropic",
        ),
        pytest.param({"query": "q", "documents": ["a", {"text": "b"}]}, "q\na\nb", id="rerank"),
        pytest.param({"text_1": "x", "text_2": ["y"]}, "x\ny", id="score"),
        pytest.param({"tokens": [1, 2, 3]}, "", id="no-text"),
    ],
)
def test_body_text(body: dict[str, object], text: str) -> None:
    assert body_text(body) == text


def test_passthrough_request_needs_only_a_model() -> None:
    raw = orjson.dumps({"model": "m", "input": "hello there", "max_output_tokens": 7})
    llm = parse_request(raw, RequestKind.RESPONSES, {}, "r")
    assert (llm.model, llm.prompt, llm.max_tokens) == ("m", "hello there", 7)
    with pytest.raises(BadRequest) as info:
        parse_request(b'{"input": "x"}', RequestKind.RESPONSES, {}, "r")
    assert info.value.param == "model"
    # vLLM's other routes default the model: no model is "any endpoint", a bad one a 400
    assert parse_request(b'{"prompt": "x"}', RequestKind.OTHER, {}, "r").model == ""
    with pytest.raises(BadRequest):
        parse_request(b'{"model": 3}', RequestKind.OTHER, {}, "r")


def test_multipart_model_is_read_and_rewritten_in_place() -> None:
    audio = bytes(range(256)) * 8
    raw = form([("file", audio, "a.wav"), ("model", b"whisper", None), ("stream", b"true", None)])
    spans = form_fields(raw, FORM_TYPE["content-type"])
    assert set(spans) == {"model", "stream"}
    llm = parse_request(raw, RequestKind.OTHER, FORM_TYPE, "r")
    assert llm.model == "whisper" and llm.stream is True
    llm.target_model = "whisper-large"
    rewritten = with_model(llm, raw)
    assert rewritten == raw.replace(b"whisper", b"whisper-large")
    assert audio in rewritten


def test_a_form_without_a_model_goes_to_any_endpoint_and_without_a_boundary_is_a_400() -> None:
    raw = form([("file", b"xx", "a.wav")])
    assert parse_request(raw, RequestKind.OTHER, FORM_TYPE, "r").model == ""
    with pytest.raises(BadRequest):
        parse_request(raw, RequestKind.OTHER, {"content-type": "multipart/form-data"}, "r")


def test_anthropic_and_responses_usage_are_read() -> None:
    anthropic = usage_from(
        {"usage": {"input_tokens": 10, "output_tokens": 4, "cache_read_input_tokens": 8}}
    )
    assert anthropic is not None
    assert (anthropic.prompt_tokens, anthropic.completion_tokens, anthropic.cached_tokens) == (
        10,
        4,
        8,
    )
    completed = usage_from(
        {
            "type": "response.completed",
            "response": {
                "usage": {
                    "input_tokens": 3,
                    "output_tokens": 2,
                    "input_tokens_details": {"cached_tokens": 1},
                }
            },
        }
    )
    assert completed is not None and completed.cached_tokens == 1


@pytest.mark.parametrize(
    ("body", "is_error"),
    [
        pytest.param(b'{"error": {"message": "m"}}', True, id="openai"),
        pytest.param(b'{"type": "error", "error": {"type": "not_found_error"}}', True, id="anth"),
        pytest.param(b'{"object": "error", "message": "m"}', True, id="vllm-flat"),
        pytest.param(b'{"detail": "Not Found"}', False, id="fastapi"),
        pytest.param(b"404: Not Found", False, id="text"),
    ],
)
def test_which_404_bodies_are_errors_already(body: bytes, is_error: bool) -> None:
    assert _is_error_object(body) is is_error


def test_subset_and_rewrite_headers() -> None:
    assert subset_of({}) is None
    assert subset_of({"x-gateway-destination-endpoint-subset": " a:1, ,b "}) == ("a:1", "b")
    assert subset_of({"x-gateway-destination-endpoint-subset": ""}) == ()
    states = [endpoint_state("10.0.0.1:80"), endpoint_state("10.0.0.1:81"), endpoint_state("c:1")]
    assert [s.address for s in within_subset(states, ["10.0.0.1:81", "z:9"])] == ["10.0.0.1:81"]
    assert [s.address for s in within_subset(states, ["10.0.0.1"])] == [
        "10.0.0.1:80",
        "10.0.0.1:81",
    ]
    assert model_rewrite_of({"x-gateway-model-name-rewrite": "old"}) == "old"
    both = {"x-llm-d-model-name-rewrite": "new", "x-gateway-model-name-rewrite": "old"}
    assert model_rewrite_of(both) == "new"
