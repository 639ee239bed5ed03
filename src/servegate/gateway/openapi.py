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
                    ],
                }
            }
        }
    return out


_ROUTING_HEADERS = [
    {"name": "x-llm-d-inference-objective", "in": "header", "schema": {"type": "string"}},
    {"name": "x-llm-d-inference-fairness-id", "in": "header", "schema": {"type": "string"}},
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


def _inference(summary: str, schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": schema[0].lower() + schema[1:],
            "parameters": _ROUTING_HEADERS,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "The replica's answer, relayed (SSE when `stream` is true)",
                    "headers": {
                        "x-gateway-destination-endpoint": {"schema": {"type": "string"}},
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
