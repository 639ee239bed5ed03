"""`/v1/messages`: Anthropic's Messages API, streaming and not, as vLLM serves it.

The request's `system` and `messages` (text content, as a string or as text
blocks) become a chat prompt for the simulated engine; the answer is one text
block. Streaming sends Anthropic's named events in order: `message_start`,
`content_block_start`, `ping`, one `content_block_delta` per piece of text,
`content_block_stop`, `message_delta` (the stop reason and the usage), and
`message_stop`. Errors use Anthropic's shape, `{"type": "error", "error": {...}}`.
Injected faults (`X-Return-Error`, `error_rate`) apply as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from servegate.simulator.engine import RequestError, SimRequest
from servegate.simulator.openai_api import (
    JSON,
    SSE_HEADERS,
    STATE,
    drop_connection,
    injected_fault,
    read_json,
    resolve_model,
    wait_finished,
)
from servegate.simulator.protocol import BadRequest
from servegate.simulator.state import SimState

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> web.Response:
    kind = ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=JSON)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise BadRequest(f"{where}[{i}] must be a content block with a 'type'")
            if block["type"] == "text":
                text = block.get("text")
                if not isinstance(text, str):
                    raise BadRequest(f"{where}[{i}].text must be a string")
                parts.append(text)
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of content blocks")


def chat_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI-style messages the chat template renders: `system` first, then the turns."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("messages: must be a non-empty list")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}]: role must be 'user' or 'assistant'")
        out.append({"role": turn["role"], "content": _text(turn.get("content"), f"messages[{i}]")})
    return out


def _params(body: dict[str, Any]) -> tuple[int, tuple[str, ...], bool]:
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens: must be a positive integer")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop_sequences: must be a list of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: must be a boolean")
    return max_tokens, tuple(stop), stream


def stop_of(req: SimRequest) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished request."""
    if req.finish_reason == "length":
        return "max_tokens", None
    if isinstance(req.stop_reason, str):
        return "stop_sequence", req.stop_reason
    return "end_turn", None


def _usage(state: SimState, req: SimRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"input_tokens": req.prompt_len, "output_tokens": req.num_output_tokens}
    if state.cfg.enable_prompt_tokens_details:
        out["cache_read_input_tokens"] = max(req.cached_tokens, 0)
    return out


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        fault = injected_fault(request, state)
        if isinstance(fault, int):
            return anthropic_error(
                fault, f"Simulated error {fault} (X-Return-Error or error_rate)."
            )
        if fault == "disconnect":
            return drop_connection(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("model: must be a non-empty string")
        max_tokens, stop, stream = _params(body)
        adapter = resolve_model(state, model)
        tokenizer = state.tokenizer
        try:
            prompt_ids = tokenizer.encode(
                tokenizer.apply_chat_template(chat_of(body), True), add_special_tokens=False
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid = "msg_" + (request.headers.get("X-Request-Id") or state.new_id())
        req = state.engine.submit(
            prompt_ids, request_id=rid, max_tokens=max_tokens, stop=stop, lora=adapter
        )
    except BadRequest as exc:
        return anthropic_error(400, exc.message)
    except RequestError as exc:
        return anthropic_error(exc.status, exc.message)
    name = adapter.name if adapter is not None else state.cfg.model
    if stream:
        req.wants_stream = True
        return await _stream(request, state, req, name, fault)
    return await _complete(request, state, req, name, fault)


async def _complete(
    request: web.Request, state: SimState, req: SimRequest, model: str, fault: object
) -> web.StreamResponse:
    engine = state.engine
    await wait_finished(state, req)
    if state.crashed or fault == "stream_cut":
        return drop_connection(request)
    if fault == "stream_error" or (req.finish_reason == "abort" and not engine.alive):
        return anthropic_error(500, "Internal server error")
    reason, sequence = stop_of(req)
    body = {
        "id": req.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": req.text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(state, req),
    }
    return web.Response(body=orjson.dumps(body), content_type=JSON)


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _delta(text: str) -> bytes:
    return event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


async def _stream(
    request: web.Request, state: SimState, req: SimRequest, model: str, fault: object
) -> web.StreamResponse:
    engine = state.engine
    resp = web.StreamResponse(headers=SSE_HEADERS)
    start: dict[str, Any] = {
        "id": req.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": req.prompt_len, "output_tokens": 0},
    }
    try:
        await resp.prepare(request)
        await resp.write(event("message_start", {"type": "message_start", "message": start}))
        await resp.write(
            event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        )
        await resp.write(event("ping", {"type": "ping"}))
        while True:
            await req.wait()
            if state.crashed:
                drop_connection(request)
                return resp
            text = req.take_text()
            if fault in ("stream_error", "stream_cut") and req.num_output_tokens >= 1:
                engine.abort(req)
                if fault == "stream_cut":
                    drop_connection(request)
                    return resp
                error = {"type": "api_error", "message": "Internal server error"}
                await resp.write(event("error", {"type": "error", "error": error}))
                return resp
            if text:
                await resp.write(_delta(text))
            if req.finished:
                break
        reason, sequence = stop_of(req)
        await resp.write(
            event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(state, req),
                },
            )
            + event("message_stop", {"type": "message_stop"})
        )
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if not req.finished:
            engine.abort(req)
    return resp
