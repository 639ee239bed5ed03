"""Triton's generate extension for a TensorRT-LLM model (PROTOCOLS.md section 8).

`POST /v2/models/{model}/generate` takes `{"text_input": ..., "max_tokens": n,
"stop_words": [...], "parameters": {...}}` (fields at the top level or inside
`parameters`) and answers `{"model_name", "model_version", "text_output", ...}`;
`text_output` holds the prompt followed by the generated text unless
`exclude_input_in_output` is true, as the TensorRT-LLM ensemble does.
`/generate_stream` answers `data: {json}\n\n` events with the new text only, no
`[DONE]`; a failure after the 200 status arrives as `data: {"error": "..."}`.
Errors are `{"error": "message"}` with status 400.

`GET /v2/models/{model}/config` (the model configuration extension) describes the
served model as TensorRT-LLM's standard repository does: an ensemble of
`preprocessing`, `tensorrt_llm` and `postprocessing`, whose pre/postprocessing
models carry `tokenizer_dir` (the simulator's HuggingFace folder, when it has one;
the built-in tokenizer has none) and `add_special_tokens: "false"` (the simulator
tokenises `text_input` without special tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from servegate.simulator.engine import RequestError, SimRequest
from servegate.simulator.openai_api import (
    JSON,
    SSE_HEADERS,
    STATE,
    drop_connection,
    error_response,
    injected_fault,
    read_json,
    wait_finished,
)
from servegate.simulator.protocol import BadRequest
from servegate.simulator.state import SimState


def _fields(body: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(body)
    params = body.get("parameters")
    if isinstance(params, dict):
        for key, value in params.items():
            merged.setdefault(key, value)
    return merged


def _text_input(fields: Mapping[str, Any]) -> str:
    text = fields.get("text_input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise BadRequest("'text_input' must be a string")
    return text


def _stop_words(fields: Mapping[str, Any]) -> tuple[str, ...]:
    raw = fields.get("stop_words")
    if raw is None or raw == "":
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise BadRequest("'stop_words' must be a string or a list of strings")


STEPS = ("preprocessing", "tensorrt_llm", "postprocessing")


def _model_config(state: SimState, model: str) -> dict[str, Any] | None:
    if model == state.cfg.model:
        return {
            "name": model,
            "platform": "ensemble",
            "max_batch_size": state.cfg.max_num_seqs,
            "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]}],
            "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["-1"]}],
            "ensemble_scheduling": {
                "step": [{"model_name": name, "model_version": "-1"} for name in STEPS]
            },
            "parameters": {},
        }
    if model == "tensorrt_llm":
        return {"name": model, "backend": "tensorrtllm", "parameters": {}}
    if model in STEPS:
        params = {"add_special_tokens": {"string_value": "false"}}
        if state.cfg.tokenizer.path is not None:
            params["tokenizer_dir"] = {"string_value": state.cfg.tokenizer.path}
        return {"name": model, "backend": "python", "parameters": params}
    return None


async def model_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model"]
    config = _model_config(state, model)
    if config is None:
        return error_response(state, 400, f"Request for unknown model: '{model}' is not found")
    return web.Response(body=orjson.dumps(config), content_type=JSON)


def _payload(state: SimState, model: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "model_name": model,
            "model_version": "1",
            "sequence_end": False,
            "sequence_id": 0,
            "sequence_start": False,
            "text_output": text,
        }
    )


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=True)


async def _generate(request: web.Request, stream: bool) -> web.StreamResponse:
    state = request.app[STATE]
    model = request.match_info["model"]
    if model != state.cfg.model:
        return error_response(state, 400, f"Request for unknown model: '{model}' is not found")
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        fault = injected_fault(request, state)
        if isinstance(fault, int):
            return error_response(state, fault, f"Simulated error {fault}")
        if fault == "disconnect":
            return drop_connection(request)
        fields = _fields(body)
        text = _text_input(fields)
        max_tokens = fields.get("max_tokens")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
        ):
            raise BadRequest("'max_tokens' must be an integer")
        exclude_input = fields.get("exclude_input_in_output", False) is True
        req = state.engine.submit(
            state.tokenizer.encode(text),
            request_id=state.new_id(),
            max_tokens=max_tokens,
            stop=_stop_words(fields),
            ignore_eos=fields.get("ignore_eos") is True,
        )
    except BadRequest as exc:
        return error_response(state, 400, exc.message)
    except RequestError as exc:
        return error_response(state, 400, exc.message)
    if stream:
        req.wants_stream = True
        return await _stream(request, state, req, fault)
    await wait_finished(state, req)
    if state.crashed or fault == "stream_cut":
        return drop_connection(request)
    if fault == "stream_error" or not state.engine.alive:
        return error_response(state, 500, "Simulated failure during generation")
    output = req.text if exclude_input else text + req.text
    return web.Response(body=_payload(state, model, output), content_type=JSON)


async def _stream(
    request: web.Request, state: SimState, req: SimRequest, fault: str | int | None
) -> web.StreamResponse:
    model = state.cfg.model
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        while True:
            await req.wait()
            if state.crashed:
                drop_connection(request)
                return resp
            text = req.take_text()
            if fault in ("stream_error", "stream_cut") and req.num_output_tokens >= 1:
                if text:
                    await resp.write(b"data: " + _payload(state, model, text) + b"\n\n")
                state.engine.abort(req)
                if fault == "stream_cut":
                    drop_connection(request)
                    return resp
                await resp.write(b'data: {"error": "Simulated failure during generation"}\n\n')
                return resp
            if text or req.finished:
                await resp.write(b"data: " + _payload(state, model, text) + b"\n\n")
            if req.finished:
                break
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        if not req.finished:
            state.engine.abort(req)
    return resp
