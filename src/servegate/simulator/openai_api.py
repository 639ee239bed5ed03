"""`/v1/completions` and `/v1/chat/completions`, streaming and not, as vLLM serves them.

A client that disconnects (the handler is cancelled, or a write fails) aborts
its request in the engine, freeing its slot and blocks at once.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from servegate.simulator.engine import RequestError, SimRequest
from servegate.simulator.faults import InjectedFault, parse_injected
from servegate.simulator.lora import Adapter
from servegate.simulator.protocol import (
    DONE,
    BadRequest,
    ChunkWriter,
    GenerationParams,
    chat_messages,
    chat_response,
    completion_prompt,
    completion_response,
    error_body,
    parse_generation,
    stream_error,
    stream_usage,
    usage,
)
from servegate.simulator.state import SimState

STATE: web.AppKey[SimState] = web.AppKey("servegate_sim_state", SimState)
JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def add_special_tokens(body: dict[str, Any], chat: bool) -> bool:
    """vLLM's request field: a completion prompt gets the tokenizer's special tokens
    (BOS) by default, a chat template renders its own."""
    value = body.get("add_special_tokens")
    return value if isinstance(value, bool) else not chat


def error_response(
    state: SimState,
    status: int,
    message: str,
    err_type: str | None = None,
    param: str | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(state.persona.error_style, message, status, err_type, param),
        content_type=JSON,
    )


def drop_connection(request: web.Request) -> web.Response:
    """Close the client's connection without an answer."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    return web.Response(status=499)


def injected_fault(request: web.Request, state: SimState) -> InjectedFault | None:
    header = request.headers.get("X-Return-Error")
    if header:
        return parse_injected(header)
    return state.faults.roll()


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from exc


def resolve_model(state: SimState, model: str | None) -> Adapter | None:
    """The LoRA adapter a request names, None for the base model; 404 otherwise."""
    if model is None or model == state.cfg.model:
        return None
    adapter = state.engine.resolve_lora(model)
    if adapter is None:
        raise RequestError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
    return adapter


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        fault = injected_fault(request, state)
        if isinstance(fault, int):
            return error_response(
                state, fault, f"Simulated error {fault} (X-Return-Error or error_rate)."
            )
        if fault == "disconnect":
            return drop_connection(request)
        params = parse_generation(body, chat)
        adapter = resolve_model(state, params.model)
        tokenizer = state.tokenizer
        prompt_text = ""
        if chat:
            messages = chat_messages(body)
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            try:
                prompt_ids = tokenizer.encode(
                    tokenizer.apply_chat_template(messages, add_generation_prompt),
                    add_special_tokens=add_special_tokens(body, chat=True),
                )
            except ValueError as exc:
                raise BadRequest(str(exc), "messages") from exc
        else:
            prompt = completion_prompt(body)
            if isinstance(prompt, str):
                prompt_text = prompt
                prompt_ids = tokenizer.encode(
                    prompt, add_special_tokens=add_special_tokens(body, chat=False)
                )
            else:
                prompt_ids = prompt
                if params.echo:
                    prompt_text = tokenizer.decode(prompt_ids)
        rid = params.request_id or request.headers.get("X-Request-Id") or state.new_id()
        rid = ("chatcmpl-" if chat else "cmpl-") + rid
        req = state.engine.submit(
            prompt_ids,
            request_id=rid,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            stop=params.stop,
            include_stop=params.include_stop,
            ignore_eos=params.ignore_eos,
            lora=adapter,
            kv_transfer_params=params.kv_transfer_params,
        )
    except BadRequest as exc:
        return error_response(state, 400, exc.message, "BadRequestError", exc.param)
    except RequestError as exc:
        return error_response(state, exc.status, exc.message, exc.err_type, exc.param)
    model_name = adapter.name if adapter is not None else state.cfg.model
    echo = prompt_text if params.echo and not chat else ""
    if params.stream:
        req.wants_stream = True
        return await _stream(request, state, req, params, chat, model_name, echo, fault)
    return await _complete(request, state, req, chat, model_name, echo, fault)


def _cached(state: SimState, req: SimRequest) -> int | None:
    return max(req.cached_tokens, 0) if state.cfg.enable_prompt_tokens_details else None


async def wait_finished(state: SimState, req: SimRequest) -> None:
    """Until the engine finishes `req`; a client gone first (cancellation) aborts it."""
    try:
        while not req.finished:
            await req.wait()
    finally:
        if not req.finished:
            state.engine.abort(req)


async def _complete(
    request: web.Request,
    state: SimState,
    req: SimRequest,
    chat: bool,
    model_name: str,
    echo: str,
    fault: InjectedFault | None,
) -> web.StreamResponse:
    engine = state.engine
    await wait_finished(state, req)
    if state.crashed or fault == "stream_cut":
        return drop_connection(request)
    if fault == "stream_error" or (req.finish_reason == "abort" and not engine.alive):
        return error_response(state, 500, "Internal server error", "InternalServerError")
    render = chat_response if chat else completion_response
    body = render(
        req.request_id,
        int(time.time()),
        model_name,
        echo + req.text,
        req.finish_reason,
        req.stop_reason,
        usage(req.prompt_len, req.num_output_tokens, _cached(state, req)),
        req.kv_transfer_params,
    )
    return web.Response(body=body, content_type=JSON)


async def _stream(
    request: web.Request,
    state: SimState,
    req: SimRequest,
    params: GenerationParams,
    chat: bool,
    model_name: str,
    echo: str,
    fault: InjectedFault | None,
) -> web.StreamResponse:
    engine = state.engine
    writer = ChunkWriter(req.request_id, int(time.time()), model_name, chat)
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        if chat:
            await resp.write(writer.role())
        if echo:
            await resp.write(writer.text(echo))
        while True:
            await req.wait()
            if state.crashed:
                drop_connection(request)
                return resp
            text = req.take_text()
            if fault in ("stream_error", "stream_cut") and req.num_output_tokens >= 1:
                if text:
                    await resp.write(writer.text(text))
                engine.abort(req)
                if fault == "stream_cut":
                    drop_connection(request)
                    return resp
                await resp.write(
                    stream_error(state.persona.error_style, "Internal server error", 500)
                )
                await resp.write(DONE)
                return resp
            if req.finished:
                await resp.write(writer.final(text, req.finish_reason, req.stop_reason))
                break
            if text:
                await resp.write(writer.text(text))
        if params.include_usage:
            await resp.write(
                writer.usage(
                    stream_usage(req.prompt_len, req.num_output_tokens, _cached(state, req))
                )
            )
        await resp.write(DONE)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if not req.finished:
            engine.abort(req)
    return resp
