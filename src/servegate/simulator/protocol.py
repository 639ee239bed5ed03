"""OpenAI wire format as vLLM speaks it: request fields in, response bodies out.

Response bodies carry the fields vLLM's pydantic models serialise (non-streaming
responses include the null ones; stream chunks only the fields vLLM sets, as it
serialises them with `exclude_unset`). Stream chunks are built from a
pre-encoded prefix and suffix so a token costs one small `orjson.dumps`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from servegate.simulator.personas import ErrorStyle

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type_for(status: int) -> str:
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def error_payload(
    style: ErrorStyle,
    message: str,
    status: int,
    err_type: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    err_type = err_type or error_type_for(status)
    if style == "triton":
        return {"error": message}
    if style == "flat":
        return {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": param,
            "code": status,
        }
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_body(
    style: ErrorStyle,
    message: str,
    status: int,
    err_type: str | None = None,
    param: str | None = None,
) -> bytes:
    return orjson.dumps(error_payload(style, message, status, err_type, param))


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """The fields of a completion or chat request the simulator acts on."""

    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    include_stop: bool
    ignore_eos: bool
    echo: bool
    kv_transfer_params: Mapping[str, Any] | None
    request_id: str | None


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer", key)
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean", key)
    return value


def parse_generation(body: Mapping[str, Any], chat: bool) -> GenerationParams:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest("The simulator serves n=1 only.", "n")
    if body.get("use_beam_search"):
        raise BadRequest("The simulator does not implement beam search.", "use_beam_search")
    max_tokens = _opt_int(body, "max_tokens")
    if chat:
        max_completion = _opt_int(body, "max_completion_tokens")
        if max_completion is not None:
            max_tokens = max_completion
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    else:
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    stream = _bool(body, "stream")
    if options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest("'kv_transfer_params' must be an object", "kv_transfer_params")
    request_id = body.get("request_id")
    return GenerationParams(
        model=model,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        continuous_usage=bool(options and options.get("continuous_usage_stats")),
        max_tokens=max_tokens,
        min_tokens=_opt_int(body, "min_tokens") or 0,
        stop=stop,
        include_stop=_bool(body, "include_stop_str_in_output"),
        ignore_eos=_bool(body, "ignore_eos"),
        echo=_bool(body, "echo"),
        kv_transfer_params=kv,
        request_id=request_id if isinstance(request_id, str) and request_id else None,
    )


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    if isinstance(prompt, list):
        raise BadRequest("The simulator serves one prompt per request.", "prompt")
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a list with one of them", "prompt"
    )


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message must be an object with a 'role'", "messages")
    return messages


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


def stream_usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_body,
            "kv_transfer_params": kv_transfer_params,
        }
    )


def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_body,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": kv_transfer_params,
        }
    )


class ChunkWriter:
    """SSE `data:` lines of one stream, sharing a pre-encoded head."""

    __slots__ = ("_chat", "_head", "_mid", "_tail", "created", "model", "rid")

    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self._chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = orjson.dumps({"id": rid, "object": obj, "created": created, "model": model})[:-1]
        if chat:
            self._head = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._head = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        self._mid = head

    def text(self, text: str) -> bytes:
        return self._head + orjson.dumps(text) + self._tail

    def role(self) -> bytes:
        return self._line(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def final(self, text: str, finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        if self._chat:
            delta = {"content": text} if text else {}
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        return self._line(choice)

    def usage(self, usage_body: dict[str, Any]) -> bytes:
        return (
            b"data: " + self._mid + b',"choices":[],"usage":' + orjson.dumps(usage_body) + b"}\n\n"
        )

    def _line(self, choice: dict[str, Any]) -> bytes:
        return b"data: " + self._mid + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"


DONE = b"data: [DONE]\n\n"


def stream_error(style: ErrorStyle, message: str, status: int = 500) -> bytes:
    return b"data: " + error_body(style, message, status) + b"\n\n"
