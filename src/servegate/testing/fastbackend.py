"""A model server that answers at once, to measure what a gateway adds.

It speaks the vLLM OpenAI protocol (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, a vLLM-shaped `/metrics` page) and does no work: every
response is canned bytes built at start-up, streamed as `chunks` SSE events (plus a
usage event when asked with `stream_options.include_usage`) or returned whole. With
the backend's own cost near zero, the latency and CPU a gateway adds in front of it
stand out. The metrics page reports zero load; only `vllm:request_success_total`
counts, so a benchmark can see which replica served how much.

    python -m servegate.testing.fastbackend --port 8100 [--chunks 16] [--model fast]

With `--port 0` the kernel picks a free port; the first stdout line always says
`listening on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
JSON_TYPE = "application/json"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class FastBackendConfig:
    model: str = "fast"
    chunks: int = 8
    """SSE events carrying text per streamed response; also the completion token count."""
    chunk_delay_s: float = 0.0
    max_model_len: int = 4096
    prompt_tokens: int = 16
    """The prompt length the canned usage reports (the prompt is not tokenized)."""


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True, slots=True)
class _Canned:
    whole: bytes
    chunks: tuple[bytes, ...]
    usage: bytes


def _usage(config: FastBackendConfig) -> dict[str, Any]:
    return {
        "prompt_tokens": config.prompt_tokens,
        "completion_tokens": config.chunks,
        "total_tokens": config.prompt_tokens + config.chunks,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _canned_chat(config: FastBackendConfig, created: int) -> _Canned:
    base = {"id": "chatcmpl-fast", "created": created, "model": config.model}
    words = ["tok "] * config.chunks
    whole = {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(words)},
                "finish_reason": "length",
            }
        ],
        "usage": _usage(config),
    }
    chunk_base = {**base, "object": "chat.completion.chunk"}
    chunks = []
    for index, word in enumerate(words):
        delta: dict[str, Any] = {"content": word}
        if index == 0:
            delta["role"] = "assistant"
        last = index == len(words) - 1
        choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
        chunks.append(_sse({**chunk_base, "choices": [choice]}))
    usage = _sse({**chunk_base, "choices": [], "usage": _usage(config)})
    return _Canned(orjson.dumps(whole), tuple(chunks), usage)


def _canned_completion(config: FastBackendConfig, created: int) -> _Canned:
    base = {"id": "cmpl-fast", "object": "text_completion", "created": created}
    base["model"] = config.model
    words = ["tok "] * config.chunks
    whole = {
        **base,
        "choices": [{"index": 0, "text": "".join(words), "finish_reason": "length"}],
        "usage": _usage(config),
    }
    chunks = []
    for index, word in enumerate(words):
        last = index == len(words) - 1
        choice = {"index": 0, "text": word, "finish_reason": "length" if last else None}
        chunks.append(_sse({**base, "choices": [choice]}))
    usage = _sse({**base, "choices": [], "usage": _usage(config)})
    return _Canned(orjson.dumps(whole), tuple(chunks), usage)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=JSON_TYPE)


class FastBackend:
    """The request handlers; everything expensive happens in `__init__`."""

    def __init__(self, config: FastBackendConfig) -> None:
        self.config = config
        created = int(time.time())
        self._chat = _canned_chat(config, created)
        self._completion = _canned_completion(config, created)
        self._models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model,
                        "object": "model",
                        "created": created,
                        "owned_by": "servegate",
                        "root": config.model,
                        "parent": None,
                        "max_model_len": config.max_model_len,
                    }
                ],
            }
        )
        self.requests_served = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, self._chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, self._completion)

    async def _answer(self, request: web.Request, canned: _Canned) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if not body.get("stream"):
            self.requests_served += 1
            return web.Response(body=canned.whole, content_type=JSON_TYPE)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        delay = self.config.chunk_delay_s
        for chunk in canned.chunks:
            if delay > 0:
                await asyncio.sleep(delay)
            await response.write(chunk)
        if include_usage:
            await response.write(canned.usage)
        await response.write(DONE)
        await response.write_eof()
        self.requests_served += 1
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=self._models, content_type=JSON_TYPE)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=metrics_page(self.config, self.requests_served),
            headers={"Content-Type": METRICS_TYPE},
        )


def metrics_page(config: FastBackendConfig, requests_served: int) -> bytes:
    labels = f'engine="0",model_name="{config.model}"'
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} 0.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} 0.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        'engine="0",num_gpu_blocks="4096",prefix_caching_hash_algo="sha256"} 1.0',
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{labels}}} 0.0",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{labels}}} 0.0",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{labels},finished_reason="length"}} {requests_served}.0',
    ]
    return ("\n".join(lines) + "\n").encode()


async def start_fast_backend(
    config: FastBackendConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Starts the backend in the running loop; returns its runner (to clean up) and port."""
    runner = web.AppRunner(FastBackend(config).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def _serve(config: FastBackendConfig, host: str, port: int) -> None:
    runner, bound = await start_fast_backend(config, host, port)
    print(f"listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="fast")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error("--chunks must be >= 1")
    config = FastBackendConfig(
        model=args.model, chunks=args.chunks, chunk_delay_s=args.chunk_delay_ms / 1000
    )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as loop:
        loop.run(_serve(config, args.host, args.port))


if __name__ == "__main__":
    main(sys.argv[1:])
