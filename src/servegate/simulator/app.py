"""The aiohttp application of one simulated server: routes per persona, faults, admin.

`build_app(cfg)` returns a ready `web.Application`; the engine loop (and the
KV-event publisher, when configured) start and stop with it through
`cleanup_ctx`. `SimServer` in `server.py` adds sockets, the Triton metrics port
and crash handling around it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from servegate.simulator import anthropic_api, openai_api, triton_api
from servegate.simulator.config import SimConfig
from servegate.simulator.engine import RequestError
from servegate.simulator.faults import FaultCommand
from servegate.simulator.kv_events import ZmqEventPublisher
from servegate.simulator.lora import LoraError
from servegate.simulator.metrics import CONTENT_TYPE, render, trtllm_iteration_stats
from servegate.simulator.openai_api import JSON, STATE, drop_connection, error_response, read_json
from servegate.simulator.protocol import BadRequest
from servegate.simulator.state import SimState
from servegate.simulator.tokenizer import Tokenizer

VLLM_VERSION = "0.32.0"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    cfg: SimConfig, *, state: SimState | None = None, tokenizer: Tokenizer | None = None
) -> web.Application:
    state = state or SimState(cfg, tokenizer)
    app = web.Application(middlewares=[_fault_middleware], client_max_size=64 * 1024**2)
    app[STATE] = state
    app.cleanup_ctx.append(_engine_ctx)
    persona = state.persona
    r = app.router
    if persona.openai:
        r.add_post("/v1/completions", openai_api.completions)
        r.add_post("/v1/chat/completions", openai_api.chat_completions)
        r.add_post("/v1/messages", anthropic_api.messages)
        r.add_get("/v1/models", models)
        r.add_post("/tokenize", tokenize)
        r.add_post("/detokenize", detokenize)
        r.add_get("/health", health)
        r.add_get("/version", version)
        r.add_post("/reset_prefix_cache", reset_prefix_cache)
        if persona.name == "vllm":
            r.add_post("/v1/load_lora_adapter", load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
        if persona.name == "trtllm-serve":
            r.add_get("/metrics", trtllm_json_metrics)
    else:
        r.add_get("/v2/health/ready", health)
        r.add_get("/v2/health/live", live)
        r.add_get("/v2", triton_server_metadata)
        r.add_get("/v2/models/{model}", triton_model_metadata)
        r.add_get("/v2/models/{model}/ready", triton_model_ready)
        r.add_get("/v2/models/{model}/config", triton_api.model_config)
        r.add_post("/v2/models/{model}/generate", triton_api.generate)
        r.add_post("/v2/models/{model}/generate_stream", triton_api.generate_stream)
    if not persona.metrics_on_own_port:
        r.add_get(persona.metrics_path, metrics)
    if cfg.admin:
        r.add_post("/admin/fault", admin_fault)
        r.add_get("/admin/fault", admin_fault_get)
        r.add_get("/admin/state", admin_state)
        r.add_get("/admin/loop_lag", admin_loop_lag)
        r.add_post("/admin/loop_lag", admin_loop_lag)
    return app


def build_metrics_app(state: SimState) -> web.Application:
    """The separate metrics listener of the Triton persona."""
    app = web.Application(middlewares=[_fault_middleware])
    app[STATE] = state
    app.router.add_get(state.persona.metrics_path, metrics)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    cfg = state.cfg
    if cfg.kv_events.enabled and state.publisher is None:
        endpoint = cfg.kv_events.endpoint or "tcp://*:5557"
        topic = cfg.kv_events.topic or f"kv@{cfg.host}:{cfg.port}@{cfg.model}"
        state.attach_publisher(
            ZmqEventPublisher(
                endpoint,
                topic,
                encoding=cfg.kv_events.encoding,
                replay_endpoint=cfg.kv_events.replay_endpoint,
                bind=cfg.kv_events.bind,
                buffer_steps=cfg.kv_events.buffer_steps,
            )
        )
    state.engine.start()
    state.loop_lag.start()
    try:
        yield
    finally:
        await state.loop_lag.stop()
        await state.engine.stop()
        if state.publisher is not None:
            state.publisher.close()


_HEALTH_PATHS = ("/health", "/v2/health/ready", "/v2/health/live")


@web.middleware
async def _fault_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path.startswith("/admin/"):
        return await handler(request)
    if state.crashed:
        return drop_connection(request)
    if state.faults.hanging:
        await state.faults.wait_unhung()
        if state.crashed:
            return drop_connection(request)
    starting = not state.faults.ready
    if starting or state.faults.mode == "unavailable":
        if request.path == "/v2/health/live":
            return web.Response(status=200)
        if request.path in _HEALTH_PATHS:
            return web.Response(status=400 if request.path.startswith("/v2/") else 503)
        message = "The server is starting." if starting else "Service Unavailable"
        return error_response(state, 503, message, "ServiceUnavailableError")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.alive:
        return web.Response(status=503)
    return web.Response(status=200)


async def live(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=render(state.registry), headers={"Content-Type": CONTENT_TYPE})


async def trtllm_json_metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=orjson.dumps(trtllm_iteration_stats(request.app[STATE].engine)), content_type=JSON
    )


def _permission(state: SimState) -> dict[str, object]:
    return {
        "id": f"modelperm-{state.new_id()}",
        "object": "model_permission",
        "created": state.started_at,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.cfg
    owner = state.persona.owned_by
    data = [
        {
            "id": cfg.model,
            "object": "model",
            "created": state.started_at,
            "owned_by": owner,
            "root": cfg.served_root,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [_permission(state)],
        }
    ]
    if state.engine.lora is not None:
        for adapter in state.engine.lora.adapters():
            data.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": owner,
                    "root": adapter.path,
                    "parent": cfg.model,
                    "max_model_len": None,
                    "permission": [_permission(state)],
                }
            )
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type=JSON)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tok = state.tokenizer
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        openai_api.resolve_model(state, body.get("model"))
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise BadRequest("'messages' must be a list", "messages")
            text = tok.apply_chat_template(
                messages, body.get("add_generation_prompt", True) is not False
            )
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise BadRequest("Either 'prompt' (a string) or 'messages' must be provided.")
        ids = tok.encode(
            text, add_special_tokens=openai_api.add_special_tokens(body, "messages" in body)
        )
    except BadRequest as exc:
        return error_response(state, 400, exc.message, "BadRequestError", exc.param)
    except RequestError as exc:
        return error_response(state, exc.status, exc.message, exc.err_type, exc.param)
    except ValueError as exc:
        return error_response(state, 400, str(exc))
    token_strs = [tok.decode([i]) for i in ids] if body.get("return_token_strs") else None
    return web.Response(
        body=orjson.dumps(
            {
                "count": len(ids),
                "max_model_len": state.cfg.max_model_len,
                "tokens": ids,
                "token_strs": token_strs,
            }
        ),
        content_type=JSON,
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BadRequest("'tokens' must be a list of integers", "tokens")
    except BadRequest as exc:
        return error_response(state, 400, exc.message, "BadRequestError", exc.param)
    return web.json_response({"prompt": state.tokenizer.decode(tokens)})


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    registry = state.engine.lora
    if registry is None:
        return error_response(
            state, 400, "LoRA is not enabled on this server (start it with LoRA)."
        )
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise LoraError(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"
            )
        registry.check_new(name, path)
        await asyncio.sleep(state.cfg.lora.load_latency_s / state.cfg.speed)
        registry.add(name, path)
    except BadRequest as exc:
        return error_response(state, 400, exc.message)
    except LoraError as exc:
        return error_response(state, exc.status, exc.message, exc.err_type)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    registry = state.engine.lora
    if registry is None:
        return error_response(
            state, 400, "LoRA is not enabled on this server (start it with LoRA)."
        )
    try:
        body = await read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        registry.remove(name if isinstance(name, str) else "")
    except BadRequest as exc:
        return error_response(state, 400, exc.message)
    except LoraError as exc:
        return error_response(state, exc.status, exc.message, exc.err_type)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.reset_prefix_cache():
        return error_response(
            state, 400, "Cannot reset the prefix cache while requests hold blocks."
        )
    return web.Response(status=200)


async def triton_server_metadata(request: web.Request) -> web.Response:
    return web.json_response(
        {"name": "triton", "version": "2.59.0", "extensions": ["generate", "model_configuration"]}
    )


async def triton_model_metadata(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model"]
    if model != state.cfg.model:
        return error_response(state, 400, f"Request for unknown model: '{model}' is not found")
    return web.json_response({"name": model, "versions": ["1"], "platform": "ensemble"})


async def triton_model_ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(status=200 if request.match_info["model"] == state.cfg.model else 400)


async def admin_fault(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        command = FaultCommand.parse(await read_json(request))
    except (BadRequest, ValueError) as exc:
        return error_response(state, 400, str(exc))
    if command.mode == "crash":
        exit_process = (
            command.exit if command.exit is not None else state.cfg.faults.crash_exits_process
        )
        resp = web.json_response({"mode": "crash", "exit": exit_process})
        await resp.prepare(request)
        await resp.write_eof()
        state.crash(exit_process)
        return resp
    state.faults.apply(command)
    return web.json_response(state.faults.describe())


async def admin_loop_lag(request: web.Request) -> web.Response:
    """Event-loop lag and RSS of this process; POST also starts a new measurement."""
    monitor = request.app[STATE].loop_lag
    summary = monitor.summary()
    if request.method == "POST":
        monitor.reset()
    return web.json_response(summary)


async def admin_fault_get(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].faults.describe())


async def admin_state(request: web.Request) -> web.Response:
    state = request.app[STATE]
    e = state.engine
    s = e.stats
    body = {
        "model": state.cfg.model,
        "persona": state.cfg.persona,
        "role": state.cfg.role,
        "running": e.num_running,
        "waiting": e.num_waiting,
        "kv_usage": e.kv.usage,
        "free_blocks": e.kv.num_free_blocks,
        "cached_blocks": e.kv.num_cached_blocks,
        "evictions": e.kv.evictions,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "preemptions": s.preemptions,
        "finished": s.finished,
        "steps": s.steps,
        "lora_resident": [] if e.lora is None else e.lora.resident,
        "kv_events_published": 0 if state.publisher is None else state.publisher.published,
        "faults": state.faults.describe(),
    }
    return web.json_response(body)
