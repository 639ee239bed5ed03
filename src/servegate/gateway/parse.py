"""Turn a request body into an `LLMRequest`, once, with OpenAI-style 400s for bad input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from servegate.gateway.errors import BadRequest
from servegate.scheduling.request import LLMRequest, RequestKind

CHARS_PER_TOKEN = 4
"""Token estimate when no tokenizer runs: the usual ~4 characters per token of English BPE."""

FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
GATEWAY_ONLY_FIELDS = ("kv_transfer_params",)
"""Body fields only the gateway may set: in vLLM's NIXL connector `kv_transfer_params` tells
the engine which host to pull KV blocks from, so a client's copy is dropped in every mode."""


def _text_of_content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"{where}[{i}] must be an object", param="messages")
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of content parts", param="messages")


def _chat_prompt(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    texts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
        texts.append(message["role"])
        texts.append(_text_of_content(message.get("content"), f"messages[{i}].content"))
    return "\n".join(texts), messages


def _completion_prompt(body: dict[str, Any]) -> tuple[str, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt), None
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "", prompt
        if all(isinstance(p, list) for p in prompt):
            ids = [t for p in prompt for t in p]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                return "", ids
    raise BadRequest(
        "'prompt' must be a string, an array of strings, or an array of token ids",
        param="prompt",
    )


def _embedding_input(body: dict[str, Any]) -> str:
    value = body.get("input")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        return "".join(v for v in value if isinstance(v, str))
    raise BadRequest("'input' must be a string or a non-empty array", param="input")


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"'{key}' must be a non-negative integer", param=key)
        return value
    return None


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def strip_gateway_fields(body: dict[str, Any]) -> bool:
    """Drops the client's `GATEWAY_ONLY_FIELDS` from `body`; True when there were any."""
    found = False
    for name in GATEWAY_ONLY_FIELDS:
        if name in body:
            del body[name]
            found = True
    return found


def parse_request(
    raw: bytes, kind: RequestKind, headers: Mapping[str, str], request_id: str
) -> LLMRequest:
    body = decode_body(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    messages = None
    token_ids = None
    if kind is RequestKind.CHAT:
        prompt, messages = _chat_prompt(body)
    elif kind is RequestKind.COMPLETION:
        prompt, token_ids = _completion_prompt(body)
    else:
        prompt = _embedding_input(body)
    fairness = ""
    for name in FAIRNESS_HEADERS:
        if name in headers:
            fairness = headers[name]
            break
    request = LLMRequest(
        request_id=request_id,
        kind=kind,
        model=model,
        target_model=model,
        base_model=model,
        prompt=prompt,
        messages=messages,
        stream=stream,
        max_tokens=_max_tokens(body),
        headers=headers,
        body=body,
        prompt_tokens=len(token_ids)
        if token_ids is not None
        else len(prompt) // CHARS_PER_TOKEN + 1,
        fairness_id=fairness,
    )
    if token_ids is not None:
        request.cache["token_ids"] = token_ids
    return request
