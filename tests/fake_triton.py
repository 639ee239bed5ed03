"""A Triton stand-in speaking the KServe v2 wire the gateway uses: real HTTP on a free port.

It answers readiness (`/v2/health/ready`), metrics (the TensorRT-LLM fixture page),
the model configuration extension (`GET /v2/models/{m}/config`: the `ModelConfig`
protobuf as JSON, snake_case field names, int64 as strings, as Triton writes it) and
the generate extension (`/generate`, `/generate_stream`) with a fixed completion. Each
model's configuration can be a document, an HTTP status or raw bytes, and can be held
back until `release()`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

METRICS = (Path(__file__).resolve().parent / "fixtures" / "metrics" / "triton.txt").read_text()


def ensemble_config(name: str = "ensemble") -> dict[str, Any]:
    """The TensorRT-LLM `inflight_batcher_llm` ensemble's configuration, as Triton returns it."""

    def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
        return {"model_name": model, "model_version": "-1", "input_map": inputs,
                "output_map": outputs, "model_namespace": ""}  # fmt: skip

    return {
        "name": name,
        "platform": "ensemble",
        "backend": "",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 64,
        "input": [
            {
                "name": "text_input",
                "data_type": "TYPE_STRING",
                "format": "FORMAT_NONE",
                "dims": ["1"],
                "optional": False,
            },
            {
                "name": "max_tokens",
                "data_type": "TYPE_INT32",
                "format": "FORMAT_NONE",
                "dims": ["1"],
                "optional": False,
            },
        ],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["-1"]}],
        "ensemble_scheduling": {
            "step": [
                step("preprocessing", {"QUERY": "text_input"}, {"INPUT_ID": "_INPUT_ID"}),
                step("tensorrt_llm", {"input_ids": "_INPUT_ID"}, {"output_ids": "_TOKENS"}),
                step("postprocessing", {"TOKENS_BATCH": "_TOKENS"}, {"OUTPUT": "text_output"}),
            ]
        },
        "parameters": {},
    }


def processing_config(
    name: str, tokenizer_dir: str, add_special_tokens: str = "${add_special_tokens}"
) -> dict[str, Any]:
    """`preprocessing` (or `postprocessing`) as `fill_template.py` left it."""
    return {
        "name": name,
        "platform": "",
        "backend": "python",
        "max_batch_size": 64,
        "parameters": {
            "tokenizer_dir": {"string_value": tokenizer_dir},
            "add_special_tokens": {"string_value": add_special_tokens},
        },
        "instance_group": [{"name": name + "_0", "kind": "KIND_CPU", "count": 1}],
    }


def trtllm_repository(tokenizer_dir: str, **preprocessing: str) -> dict[str, Any]:
    """Model name → configuration for a standard TensorRT-LLM model repository."""
    return {
        "ensemble": ensemble_config(),
        "preprocessing": processing_config("preprocessing", tokenizer_dir, **preprocessing),
        "postprocessing": processing_config("postprocessing", tokenizer_dir),
        "tensorrt_llm": {"name": "tensorrt_llm", "backend": "tensorrtllm", "parameters": {}},
    }


class FakeTriton:
    def __init__(self, configs: dict[str, Any], completion: str) -> None:
        self.configs = configs
        """Model → its configuration: a dict (200 JSON), an int (that status), or bytes."""
        self.completion = completion
        self.config_requests: Counter[str] = Counter()
        self.text_inputs: list[str] = []
        self._open = asyncio.Event()
        self._open.set()
        self._server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return str(self._server.make_url("")).rstrip("/")

    def hold(self) -> None:
        """Model configuration requests wait until `release()`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def __aenter__(self) -> FakeTriton:
        app = web.Application()
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v2/models/{model}/config", self._config)
        app.router.add_post("/v2/models/{model}/generate", self._generate)
        app.router.add_post("/v2/models/{model}/generate_stream", self._generate_stream)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        if self._server is not None:
            await self._server.close()

    async def _ready(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _config(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        self.config_requests[model] += 1
        await self._open.wait()
        found = self.configs.get(model)
        if found is None:
            error = {"error": f"Request for unknown model: '{model}' is not found"}
            return web.Response(status=400, body=orjson.dumps(error))
        if isinstance(found, int):
            return web.Response(status=found)
        if isinstance(found, bytes):
            return web.Response(body=found, content_type="text/html")
        return web.Response(body=orjson.dumps(found), content_type="application/json")

    async def _text_input(self, request: web.Request) -> str:
        body = await request.json()
        text = body["text_input"]
        self.text_inputs.append(text)
        return str(text)

    def _payload(self, model: str, text: str) -> bytes:
        return orjson.dumps({"model_name": model, "model_version": "1", "sequence_end": False,
                             "sequence_id": 0, "sequence_start": False, "text_output": text})  # fmt: skip

    async def _generate(self, request: web.Request) -> web.Response:
        await self._text_input(request)
        body = self._payload(request.match_info["model"], self.completion)
        return web.Response(body=body, content_type="application/json")

    async def _generate_stream(self, request: web.Request) -> web.StreamResponse:
        await self._text_input(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = self.completion.split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        for piece in pieces:
            await resp.write(
                b"data: " + self._payload(request.match_info["model"], piece) + b"\n\n"
            )
        await resp.write_eof()
        return resp
