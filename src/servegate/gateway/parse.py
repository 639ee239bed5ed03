"""Turn a request body into an `LLMRequest`, once, with OpenAI-style 400s for bad input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from servegate.control.errors import BadRequest
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


TEXT_KEYS = (
    "instructions", "system", "messages", "input", "prompt", "query", "queries", "documents",
    "text", "text_1", "text_2", "content",
)  # fmt: skip
"""Where the text of a body other than chat, completion or embeddings is looked for."""
MAX_TEXT_DEPTH = 6


def _texts(value: Any, out: list[str], depth: int = 0) -> None:
    if isinstance(value, str):
        out.append(value)
    elif depth >= MAX_TEXT_DEPTH:
        return
    elif isinstance(value, list):
        for item in value:
            _texts(item, out, depth + 1)
    elif isinstance(value, dict):
        for key in TEXT_KEYS:
            if key in value:
                _texts(value[key], out, depth + 1)


def body_text(body: dict[str, Any]) -> str:
    """The text a body carries (Responses `input`, Anthropic `system` and `messages`, rerank
    `query` and `documents`, …), in field order; "" when it has none."""
    out: list[str] = []
    _texts(body, out)
    return "\n".join(out)


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
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
    if kind is RequestKind.OTHER and _is_form(headers):
        return parse_form(raw, headers, request_id)
    body = decode_body(raw)
    return _parsed(body, kind, headers, request_id)


REQUEST_FIELDS = (
    "request_id", "kind", "model", "target_model", "base_model", "lora", "prompt", "messages",
    "stream", "max_tokens", "headers", "body", "prompt_tokens", "priority", "fairness_id",
)  # fmt: skip
"""The `LLMRequest` fields `_parsed` passes by position, in order (a test pins them)."""


def _parsed(
    body: dict[str, Any], kind: RequestKind, headers: Mapping[str, str], request_id: str
) -> LLMRequest:
    model = body.get("model")
    if model is None and kind is RequestKind.OTHER:
        model = ""  # vLLM's other routes default to the served model: any endpoint may answer
    elif not isinstance(model, str) or not model:
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
    elif kind is RequestKind.EMBEDDING:
        prompt = _embedding_input(body)
    else:
        prompt = body_text(body)
    fairness = ""
    for name in FAIRNESS_HEADERS:
        if name in headers:
            fairness = headers[name]
            break
    # positional, in `REQUEST_FIELDS` order: a keyword call of 15 fields costs twice as much
    request = LLMRequest(
        request_id,
        kind,
        model,
        model,
        model,
        None,
        prompt,
        messages,
        stream,
        _max_tokens(body),
        headers,
        body,
        len(token_ids) if token_ids is not None else len(prompt) // CHARS_PER_TOKEN + 1,
        0,
        fairness,
    )
    if token_ids is not None:
        request.cache["token_ids"] = token_ids
    return request


# -- multipart forms (`/v1/audio/transcriptions`, `/v1/audio/translations`) -------------

FORM_FIELDS = ("model", "stream")


def _is_form(headers: Mapping[str, str]) -> bool:
    return headers.get("content-type", "").lower().startswith("multipart/form-data")


def _boundary(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip('"').encode("latin-1")
    raise BadRequest("multipart/form-data without a boundary")


def form_fields(raw: bytes, content_type: str) -> dict[str, tuple[int, int]]:
    """Where the small text fields (`model`, `stream`) of a multipart body lie: name →
    (start, end) of the value in `raw`. The file parts are skipped, never copied."""
    delimiter = b"--" + _boundary(content_type)
    out: dict[str, tuple[int, int]] = {}
    pos = raw.find(delimiter)
    while pos >= 0:
        head_start = pos + len(delimiter)
        if raw.startswith(b"--", head_start):
            break
        head_end = raw.find(b"\r\n\r\n", head_start)
        if head_end < 0:
            break
        head = raw[head_start:head_end].decode("latin-1").lower()
        value_start = head_end + 4
        nxt = raw.find(b"\r\n" + delimiter, value_start)
        if nxt < 0:
            break
        for name in FORM_FIELDS:
            if f'name="{name}"' in head and "filename=" not in head:
                out[name] = (value_start, nxt)
        pos = nxt + 2
    return out


def parse_form(raw: bytes, headers: Mapping[str, str], request_id: str) -> LLMRequest:
    """A multipart request: routed by its `model` field; the audio itself is not read."""
    spans = form_fields(raw, headers.get("content-type", ""))
    span = spans.get("model")
    body: dict[str, Any] = {}
    if span is not None:
        body["model"] = raw[span[0] : span[1]].decode("utf-8", "replace").strip()
    stream_span = spans.get("stream")
    if stream_span is not None:
        body["stream"] = raw[stream_span[0] : stream_span[1]].strip().lower() == b"true"
    request = _parsed(body, RequestKind.OTHER, headers, request_id)
    if span is not None:
        request.cache["form_model_span"] = span
    return request


def with_model(request: LLMRequest, raw: bytes) -> bytes:
    """The body to forward, asking for `request.target_model`."""
    span = request.cache.get("form_model_span")
    if span is not None:
        return raw[: span[0]] + request.target_model.encode() + raw[span[1] :]
    request.body["model"] = request.target_model
    return orjson.dumps(request.body)
