from dataclasses import fields

import orjson
import pytest

from servegate.gateway.errors import BadRequest
from servegate.gateway.parse import REQUEST_FIELDS, parse_request
from servegate.scheduling.request import LLMRequest, RequestKind

CHAT = RequestKind.CHAT
COMPLETION = RequestKind.COMPLETION
EMBEDDING = RequestKind.EMBEDDING


def parse(body: object, kind: RequestKind = CHAT, headers: dict[str, str] | None = None):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(raw, kind, headers or {}, "rid")


def test_chat_fields() -> None:
    req = parse(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}],
                },
            ],
            "stream": True,
            "max_completion_tokens": 7,
        },
        headers={"x-llm-d-inference-fairness-id": "tenant-a"},
    )
    assert (req.model, req.stream, req.max_tokens, req.fairness_id) == ("m", True, 7, "tenant-a")
    assert req.prompt == "system\nbe brief\nuser\nhi"
    # 23 characters // 4 + 1 = 6
    assert req.prompt_tokens == 6


def test_the_request_is_built_in_field_order() -> None:
    """`_parsed` passes the fields by position: a field added or moved among them in
    `LLMRequest` must be met there too."""
    names = [f.name for f in fields(LLMRequest)]
    assert names[: len(REQUEST_FIELDS)] == list(REQUEST_FIELDS)
    req = parse(
        {"model": "m", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 5},
        headers={"x-gateway-inference-fairness-id": "f"},
    )
    assert (req.request_id, req.kind, req.model, req.target_model, req.base_model) == (
        "rid",
        CHAT,
        "m",
        "m",
        "m",
    )
    assert (req.lora, req.prompt, req.stream, req.max_tokens) == (None, "user\nhey", False, 5)
    assert req.messages == [{"role": "user", "content": "hey"}]
    assert (req.headers, req.prompt_tokens, req.priority) == (
        {"x-gateway-inference-fairness-id": "f"},
        3,  # 8 characters // 4 + 1
        0,
    )
    assert (req.fairness_id, req.cache) == ("f", {})
    assert req.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hey"}],
        "max_tokens": 5,
    }


@pytest.mark.parametrize(
    ("prompt", "text", "tokens"),
    [
        pytest.param("abcdefgh", "abcdefgh", 3, id="string"),  # 8 // 4 + 1
        pytest.param(["ab", "cd"], "abcd", 2, id="strings"),  # 4 // 4 + 1
        pytest.param([1, 2, 3], "", 3, id="token-ids"),
        pytest.param([[1, 2], [3]], "", 3, id="batched-token-ids"),
    ],
)
def test_completion_prompts(prompt: object, text: str, tokens: int) -> None:
    req = parse({"model": "m", "prompt": prompt}, COMPLETION)
    assert (req.prompt, req.prompt_tokens) == (text, tokens)


def test_embeddings_input() -> None:
    assert parse({"model": "m", "input": ["a", "b"]}, EMBEDDING).prompt == "ab"


@pytest.mark.parametrize(
    ("body", "kind", "param", "fragment"),
    [
        pytest.param(b"{not json", CHAT, None, "not valid JSON", id="bad-json"),
        pytest.param(b"[1]", CHAT, None, "JSON object", id="not-object"),
        pytest.param(
            {"messages": [{"role": "user", "content": "x"}]},
            CHAT,
            "model",
            "'model'",
            id="no-model",
        ),
        pytest.param({"model": 3, "messages": []}, CHAT, "model", "'model'", id="model-not-str"),
        pytest.param({"model": "m"}, CHAT, "messages", "'messages'", id="no-messages"),
        pytest.param(
            {"model": "m", "messages": []}, CHAT, "messages", "non-empty", id="empty-messages"
        ),
        pytest.param(
            {"model": "m", "messages": ["x"]}, CHAT, "messages", "role", id="message-not-object"
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "u", "content": 5}]},
            CHAT,
            "messages",
            "content",
            id="content",
        ),
        pytest.param({"model": "m"}, COMPLETION, "prompt", "'prompt'", id="no-prompt"),
        pytest.param(
            {"model": "m", "prompt": [1, "a"]}, COMPLETION, "prompt", "'prompt'", id="mixed-prompt"
        ),
        pytest.param(
            {"model": "m", "prompt": [True]}, COMPLETION, "prompt", "'prompt'", id="bool-tokens"
        ),
        pytest.param(
            {"model": "m", "prompt": "x", "stream": "yes"},
            COMPLETION,
            "stream",
            "boolean",
            id="stream",
        ),
        pytest.param(
            {"model": "m", "prompt": "x", "max_tokens": -1},
            COMPLETION,
            "max_tokens",
            "non-negative",
            id="max-tokens",
        ),
        pytest.param({"model": "m", "input": 3}, EMBEDDING, "input", "'input'", id="bad-input"),
    ],
)
def test_bad_requests_are_400_with_param(
    body: object, kind: RequestKind, param: str | None, fragment: str
) -> None:
    with pytest.raises(BadRequest) as info:
        parse(body, kind)
    assert info.value.status == 400
    assert info.value.param == param
    assert fragment in info.value.message
