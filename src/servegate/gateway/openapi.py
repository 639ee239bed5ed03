"""The OpenAPI 3.1 document of the gateway's own routes, served at /openapi.json.

It describes what the gateway accepts and answers, including every error it can
produce; request bodies list the fields routing reads and allow the rest (they
are forwarded to the replica unchanged). The schemathesis tests generate
requests from this document, so it must stay true to the handlers.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

_ERROR = {"$ref": "#/components/schemas/Error"}


def _error_response(description: str, dropped: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ERROR}},
    }
    if dropped:
        out["headers"] = {
            "x-llm-d-request-dropped-reason": {
                "schema": {
                    "type": "string",
                    "enum": [
                        "rejected-saturated",
                        "rejected-ttl-expired",
                        "rejected-no-endpoints",
                        "rejected-shutting-down",
                    ],
                }
            }
        }
    return out


_ROUTING_HEADERS: list[dict[str, Any]] = [
    {"name": "x-llm-d-inference-objective", "in": "header", "schema": {"type": "string"}},
    {"name": "x-llm-d-inference-fairness-id", "in": "header", "schema": {"type": "string"}},
    {"name": "x-llm-d-model-name-rewrite", "in": "header", "schema": {"type": "string"}},
    {
        "name": "x-gateway-destination-endpoint-subset",
        "in": "header",
        "description": "Comma-separated ip:port (or ip) of pool members to choose among",
        "schema": {"type": "string"},
    },
    {"name": "X-Request-ID", "in": "header", "schema": {"type": "string", "maxLength": 128}},
]

_INFERENCE_ERRORS = {
    "400": _error_response("Malformed JSON or fields"),
    "401": _error_response("Missing or wrong API key"),
    "404": _error_response("Unknown model"),
    "413": _error_response("Request body too large"),
    "429": _error_response("Shed by flow control (saturated, queue full or TTL expired)", True),
    "502": _error_response("Every endpoint tried failed before answering"),
    "503": _error_response("No endpoint takes requests for this model", True),
    "504": _error_response("The endpoint did not answer in time"),
}

_MAX_TOKENS = {"type": "integer", "minimum": 0}
_CONTENT = {
    "anyOf": [
        {"type": "string"},
        {"type": "null"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
            },
        },
    ]
}


def _inference(
    summary: str,
    schema: str,
    op: str | None = None,
    form: bool = False,
    path_param: str | None = None,
) -> dict[str, Any]:
    content: dict[str, Any] = {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}
    }
    if form:
        content["multipart/form-data"] = {"schema": {"$ref": "#/components/schemas/AudioForm"}}
    parameters: list[dict[str, Any]] = list(_ROUTING_HEADERS)
    if path_param is not None:
        parameters.append(
            {"name": path_param, "in": "path", "required": True, "schema": {"type": "string"}}
        )
    return {
        "post": {
            "summary": summary,
            "operationId": op or schema[0].lower() + schema[1:],
            "parameters": parameters,
            "requestBody": {"required": True, "content": content},
            "responses": {
                "200": {
                    "description": "The replica's answer, relayed (SSE when `stream` is true)",
                    "headers": {
                        "x-gateway-destination-endpoint": {"schema": {"type": "string"}},
                        "x-gateway-destination-endpoint-served": {"schema": {"type": "string"}},
                        "x-llm-d-flow-queue-duration-ms": {"schema": {"type": "string"}},
                    },
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_INFERENCE_ERRORS,
            },
        }
    }


def _plain(
    summary: str, op: str, content: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {content: {"schema": {}}}}}
    responses.update(extra or {})
    return {"get": {"summary": summary, "operationId": op, "responses": responses}}


def _admin(summary: str, op: str, method: str, path_param: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "summary": summary,
        "operationId": op,
        "security": [{"adminKey": []}],
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            "401": _error_response("Missing or wrong admin key"),
            "403": _error_response("The admin API is disabled (no admin keys configured)"),
        },
    }
    if path_param:
        out["parameters"] = [
            {"name": "address", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
        out["responses"]["404"] = _error_response("No such endpoint in the pool")
    return {method: out}


PASSTHROUGH = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/rerank": "rerank",
    "/v1/score": "scoreV1",
    "/v1/rerank": "rerankV1",
    "/v2/rerank": "rerankV2",
    "/v1/audio/transcriptions": "audioTranscriptions",
    "/v1/audio/translations": "audioTranslations",
    "/v1/audio/speech": "audioSpeech",
}
"""Routes forwarded by their `model` alone (mirrors `app.PASSTHROUGH_ROUTES`)."""


def _passthrough_paths() -> dict[str, Any]:
    out = {
        path: _inference(
            f"{path}: forwarded to a replica of the model", "ModelRequest", op, "/audio/t" in path
        )
        for path, op in PASSTHROUGH.items()
    }
    out["/v1/{tail}"] = _inference(
        "Any other POST /v1/...: forwarded to a replica of the model",
        "ModelRequest",
        "passthroughV1",
        path_param="tail",
    )
    return out


def _model_path() -> dict[str, Any]:
    get = _plain(
        "One model of GET /v1/models",
        "getModel",
        "application/json",
        {
            "401": _error_response("Missing or wrong API key"),
            "404": _error_response("Unknown model"),
        },
    )
    get["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return get


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "servegate gateway",
            "version": "1",
            "description": "OpenAI-compatible inference gateway with an llm-d style endpoint picker.",
        },
        "paths": {
            "/v1/chat/completions": _inference("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _inference("Text completion", "CompletionRequest"),
            "/v1/embeddings": _inference("Embeddings", "EmbeddingRequest"),
            "/v1/responses": _inference("OpenAI Responses API", "ResponsesRequest"),
            "/v1/messages": _inference("Anthropic Messages API", "MessagesRequest"),
            **_passthrough_paths(),
            "/v1/models/{model}": _model_path(),
            "/v1/models": _plain(
                "Models the pool serves",
                "listModels",
                "application/json",
                {"401": _error_response("Missing or wrong API key")},
            ),
            "/health": _plain("Liveness", "health", "text/plain"),
            "/ready": _plain(
                "Readiness: at least one endpoint takes requests",
                "ready",
                "application/json",
                {
                    "503": {
                        "description": "No endpoint is ready",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            ),
            "/metrics": _plain("Prometheus metrics", "metrics", "text/plain"),
            "/openapi.json": _plain("This document", "openapi", "application/json"),
            "/ui": _plain(
                "Status page (HTML; wants an admin key when admin keys are set)",
                "statusPage",
                "text/html",
                {"401": _error_response("Missing or wrong admin key")},
            ),
            "/ui/state.json": _plain(
                "What the status page shows: endpoints, routing share, hit rate, decisions",
                "statusState",
                "application/json",
                {"401": _error_response("Missing or wrong admin key")},
            ),
            "/admin/pool": _admin("Pool state", "adminPool", "get", False),
            "/admin/pools": _admin(
                "Every pool's state and the model rewrites", "adminPools", "get", False
            ),
            "/admin/reload": _admin(
                "Re-read the config file (422: rejected, the old config stays)",
                "adminReload",
                "post",
                False,
            ),
            "/admin/scaleout": _admin(
                "Scale-out state: peers, shared in-flight counts, what is not shared",
                "adminScaleout",
                "get",
                False,
            ),
            "/admin/endpoints/{address}/drain": _admin(
                "Drain an endpoint", "adminDrain", "post", True
            ),
            "/admin/endpoints/{address}/undrain": _admin(
                "Undrain an endpoint", "adminUndrain", "post", True
            ),
        },
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer"},
                "adminKey": {"type": "http", "scheme": "bearer"},
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "integer", "null"]},
                            },
                        }
                    },
                },
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "messages": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["role"],
                                "properties": {"role": {"type": "string"}, "content": _CONTENT},
                            },
                        },
                        "stream": {"type": "boolean"},
                        "max_tokens": _MAX_TOKENS,
                        "max_completion_tokens": _MAX_TOKENS,
                    },
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "prompt": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {"type": "integer", "minimum": 0},
                                },
                            ]
                        },
                        "stream": {"type": "boolean"},
                        "max_tokens": _MAX_TOKENS,
                    },
                },
                "ResponsesRequest": {
                    "type": "object",
                    "required": ["model"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                        "instructions": {"type": ["string", "null"]},
                        "stream": {"type": "boolean"},
                        "max_output_tokens": _MAX_TOKENS,
                    },
                },
                "MessagesRequest": {
                    "type": "object",
                    "required": ["model", "messages", "max_tokens"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "system": _CONTENT,
                        "messages": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["role"],
                                "properties": {"role": {"type": "string"}, "content": _CONTENT},
                            },
                        },
                        "stream": {"type": "boolean"},
                        "max_tokens": _MAX_TOKENS,
                    },
                },
                "ModelRequest": {
                    "type": "object",
                    "description": "Routed by `model`; without one, to any endpoint of the first pool",
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "stream": {"type": "boolean"},
                    },
                },
                "AudioForm": {
                    "type": "object",
                    "required": ["model", "file"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "file": {"type": "string", "format": "binary"},
                    },
                },
                "EmbeddingRequest": {
                    "type": "object",
                    "required": ["model", "input"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "input": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                            ]
                        },
                    },
                },
            },
        },
    }


_DOCUMENT = orjson.dumps(openapi_document())


async def serve_openapi(request: web.Request) -> web.Response:
    return web.Response(body=_DOCUMENT, content_type="application/json")


def openapi_json() -> bytes:
    """The document as served, for data planes other than aiohttp's."""
    return _DOCUMENT
