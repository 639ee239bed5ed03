"""OpenAI completions and chat in front of Triton's generate API (TensorRT-LLM backend).

Triton has no OpenAI server; its generate extension (PROTOCOLS.md section 8) takes
`POST /v2/models/{name}/generate` or `/generate_stream` with the TensorRT-LLM
ensemble's (or `tensorrt_llm_bls`'s) input tensors as top-level JSON fields. The
proxy calls these pure functions once per attempt on a Triton target:

- `TritonTranslator.prepare`: the OpenAI body → a `TritonRequest` (chat messages
  rendered with the model's chat template, sampling fields mapped, anything the
  backend cannot honour refused with a 400), built once per client request;
- `TritonRequest.call`: the path and JSON body for one endpoint, whose labels say
  the model's name in the Triton repository and how its stream reports text;
- `completion_response`, `triton_error` and `triton_stream.TritonStream`: Triton's
  answer → OpenAI's, with `usage`.

Triton returns no token counts. `usage` counts with the model's tokenizer: the
one the pool configures (`hf` or `simulator`; `engine` uses its fallback), else
the one learned from Triton's model configuration (`triton_tokens.py`), else,
until or unless that is learned, one token per four characters of text;
`usage.token_count_source` says which (`tokenizer` or `estimate`). Triton gives
no finish reason either: `length` when the completion used its `max_tokens`,
else `stop`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from servegate.config import PoolSettings
from servegate.gateway.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from servegate.gateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    UpstreamFailed,
    error_body,
)
from servegate.gateway.parse import decode_body
from servegate.gateway.triton_tokens import ESTIMATE, TokenCounter, TritonTokenCounts
from servegate.pool.endpoint import Endpoint
from servegate.tokenization.settings import TokenizerSettings
from servegate.tokenization.sources import TokenizerError, local_tokenizer

TRITON_ENGINE = "triton-tensorrt-llm"
TRITON_ADAPTER = "triton-generate"
"""The `EngineSpec.request_adapter` this module implements."""
MODEL_LABEL = "servegate.io/triton-model"
"""The model's name in the Triton repository (`ensemble`, `tensorrt_llm_bls`); default: the
OpenAI model name."""
ACCUMULATE_LABEL = "servegate.io/triton-accumulate-tokens"
"""`"true"` when the BLS model runs with `accumulate_tokens`: each stream event then holds
the whole text so far instead of the new text."""
MAX_TOKENS_LABEL = "servegate.io/triton-max-tokens"
"""`max_tokens` to send when a chat request sets none (Triton requires one)."""
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's documented default for `/v1/completions`."""

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
SAMPLING: Mapping[str, tuple[str, type | tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", int),
    "seed": ("random_seed", int),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "length_penalty": ("length_penalty", (int, float)),
    "min_tokens": ("min_length", int),
}
"""OpenAI (and vLLM extension) field → TensorRT-LLM ensemble/BLS input, with its JSON type."""
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "functions")
"""Fields Triton's generate API cannot honour: refused rather than silently dropped."""
UNKNOWN_MODEL = re.compile(r"unknown model", re.IGNORECASE)


class UpstreamUnavailable(GatewayError):
    status = 503
    type = "service_unavailable_error"
    code = "upstream_unavailable"


@dataclass(frozen=True, slots=True)
class TritonModel:
    """How one model is translated: its chat template and its token counter."""

    template: ChatTemplate
    counter: TokenCounter


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "token_count_source": self.source,
        }


@dataclass(slots=True)
class TritonRequest:
    """One OpenAI request, translated once; `call` shapes it for each Triton endpoint."""

    chat: bool
    model: str
    prompt: str
    stream: bool
    max_tokens: int | None
    inputs: dict[str, Any]
    include_usage: bool
    response_id: str
    created: int
    counter: TokenCounter
    prompt_tokens: int

    def call(self, endpoint: Endpoint) -> tuple[str, bytes]:
        labels = endpoint.labels
        name = labels.get(MODEL_LABEL) or self.model
        suffix = "generate_stream" if self.stream else "generate"
        body = dict(self.inputs)
        body["max_tokens"] = self.max_tokens_for(endpoint)
        return f"/v2/models/{quote(name, safe='')}/{suffix}", orjson.dumps(body)

    def max_tokens_for(self, endpoint: Endpoint) -> int:
        if self.max_tokens is not None:
            return self.max_tokens
        if not self.chat:
            return DEFAULT_COMPLETION_MAX_TOKENS
        raw = endpoint.labels.get(MAX_TOKENS_LABEL)
        return int(raw) if raw is not None and raw.isdigit() else DEFAULT_CHAT_MAX_TOKENS

    def usage(self, completion_text: str) -> Usage:
        return Usage(self.prompt_tokens, self.counter.count(completion_text), self.counter.source)

    def finish_reason(self, usage: Usage, max_tokens: int) -> str:
        return "length" if usage.completion_tokens >= max_tokens else "stop"


def accumulates(endpoint: Endpoint) -> bool:
    return endpoint.labels.get(ACCUMULATE_LABEL, "").lower() == "true"


def _number(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"'{key}' must be a number", param=key)
    return value


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = _number(body, key, int)
        if value is not None:
            if value < 1:
                raise BadRequest(f"'{key}' must be at least 1", param=key)
            return int(value)
    return None


def _stop_words(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise BadRequest("'stop' must be a string or a list of strings", param="stop")


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for key in UNSUPPORTED:
        value = body.get(key)
        if value is not None and value is not False and value != [] and value != 0:
            raise BadRequest(
                f"'{key}' is not supported by this model's Triton (TensorRT-LLM) backend",
                param=key,
            )
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            raise BadRequest(
                f"'{key}' must be 1 for this model's Triton (TensorRT-LLM) backend", param=key
            )
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise BadRequest(
            "'response_format' other than text is not supported by the Triton backend",
            param="response_format",
        )


def _completion_prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(
            "'prompt' must be one string for this model's Triton backend", param="prompt"
        )
    return prompt


class TritonTranslator:
    """Per model, how to translate: built once at startup from the pool's model declarations."""

    def __init__(
        self,
        models: Mapping[str, TritonModel] | None = None,
        default: TritonModel | None = None,
        learned: TritonTokenCounts | None = None,
    ) -> None:
        self._models = dict(models or {})
        self._default = default or TritonModel(load_chat_template(), ESTIMATE)
        self.learned = learned
        """Tokenizers learned from Triton's model configuration, for models without one."""

    @classmethod
    def from_pool(
        cls,
        pool: PoolSettings,
        config_dir: Path | None = None,
        learned: TritonTokenCounts | None = None,
    ) -> TritonTranslator:
        """Raises `ChatTemplateError` or `TokenizerError` for a bad template or tokenizer."""
        default_tok = _counter(pool.tokenizer)
        default_path = pool.tokenizer.path if pool.tokenizer is not None else None
        models = {}
        for decl in pool.models:
            tokenizer = decl.tokenizer or pool.tokenizer
            path = tokenizer.path if tokenizer is not None else None
            models[decl.id] = TritonModel(
                load_chat_template(decl.chat_template, path, config_dir),
                _counter(decl.tokenizer) if decl.tokenizer is not None else default_tok,
            )
        default = TritonModel(load_chat_template(None, default_path, config_dir), default_tok)
        return cls(models, default, learned)

    def model(self, name: str) -> TritonModel:
        return self._models.get(name, self._default)

    def counter(self, model: str, endpoint: Endpoint | None) -> TokenCounter:
        """The configured counter, else the learned one, else the estimate (never waits)."""
        counter = self.model(model).counter
        if counter.source == "tokenizer" or self.learned is None or endpoint is None:
            return counter
        name = endpoint.labels.get(MODEL_LABEL) or model
        return self.learned.counter(model, endpoint.url, name) or counter

    def prepare(
        self, path: str, raw: bytes, request_id: str, endpoint: Endpoint | None = None
    ) -> TritonRequest:
        """`endpoint`: the first Triton endpoint tried, asked for the model's tokenizer."""
        body = decode_body(raw)
        chat = path == CHAT_PATH
        if not chat and path != COMPLETIONS_PATH:
            raise BadRequest(f"{path} is not served by Triton endpoints")
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", param="model")
        _refuse_unsupported(body)
        translation = self.model(model)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise BadRequest("'messages' must be a list", param="messages")
            try:
                prompt = translation.template.render(messages, body)
            except ChatTemplateError as exc:
                raise BadRequest(str(exc), param="messages") from exc
        else:
            prompt = _completion_prompt(body)
        stream = body.get("stream") is True
        inputs: dict[str, Any] = {"text_input": prompt, "stream": stream}
        for field, (name, kind) in SAMPLING.items():
            value = _number(body, field, kind)
            if value is not None:
                inputs[name] = value
        stop = _stop_words(body)
        if stop:
            inputs["stop_words"] = stop
        if not stream:
            inputs["exclude_input_in_output"] = True
        options = body.get("stream_options")
        include_usage = (
            stream and isinstance(options, dict) and options.get("include_usage") is True
        )
        counter = self.counter(model, endpoint)
        try:
            prompt_tokens = counter.count_prompt(prompt, chat)
        except (TokenizerError, ValueError, TypeError) as exc:
            raise BadRequest(f"the prompt cannot be tokenised: {exc}") from exc
        return TritonRequest(
            chat=chat,
            model=model,
            prompt=prompt,
            stream=stream,
            max_tokens=_max_tokens(body),
            inputs=inputs,
            include_usage=include_usage,
            response_id=("chatcmpl-" if chat else "cmpl-") + request_id,
            created=int(time.time()),
            counter=counter,
            prompt_tokens=prompt_tokens,
        )


def _counter(settings: TokenizerSettings | None) -> TokenCounter:
    if settings is None:
        return ESTIMATE
    return TokenCounter(local_tokenizer(settings.local_source, settings.path))


def completion_response(
    request: TritonRequest, endpoint: Endpoint, data: bytes
) -> tuple[bytes, Usage]:
    """Triton's `/generate` answer → an OpenAI completion or chat completion."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamFailed(f"endpoint {endpoint.address} answered invalid JSON") from exc
    text = doc.get("text_output") if isinstance(doc, dict) else None
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise UpstreamFailed(f"endpoint {endpoint.address} answered without 'text_output'")
    if request.prompt and text.startswith(request.prompt):
        text = text[len(request.prompt) :]
    usage = request.usage(text)
    finish = request.finish_reason(usage, request.max_tokens_for(endpoint))
    choice: dict[str, Any]
    if request.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return orjson.dumps(
        {
            "id": request.response_id,
            "object": "chat.completion" if request.chat else "text_completion",
            "created": request.created,
            "model": request.model,
            "choices": [choice],
            "usage": usage.as_dict(),
        }
    ), usage


def triton_message(data: bytes) -> str | None:
    """The message of Triton's `{"error": "..."}` body, if that is what `data` is."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    message = doc.get("error") if isinstance(doc, dict) else None
    return message if isinstance(message, str) else None


def triton_error(status: int, data: bytes, endpoint: Endpoint) -> GatewayError:
    """A non-200 Triton answer as the OpenAI error the client sees.

    Triton maps its error codes onto HTTP (`HttpCodeFromError`): INVALID_ARG and
    UNKNOWN → 400, NOT_FOUND → 404, UNSUPPORTED → 501, UNAVAILABLE → 503,
    INTERNAL → 500; older releases answer an unknown model with 400.
    """
    message = triton_message(data) or f"endpoint {endpoint.address} answered {status}"
    if status == 404 or (status == 400 and UNKNOWN_MODEL.search(message)):
        return ModelNotFound(f"Triton endpoint {endpoint.address}: {message}")
    if status in (400, 422, 501):
        return BadRequest(message)
    if status == 503:
        return UpstreamUnavailable(f"endpoint {endpoint.address} is unavailable: {message}")
    if status >= 500:
        return UpstreamFailed(f"endpoint {endpoint.address} failed: {message}")
    exc = BadRequest(message)
    exc.status = status
    return exc


def render_error(exc: GatewayError) -> bytes:
    return error_body(exc.message, exc.type, exc.code, exc.param)


def chunk(
    request: TritonRequest,
    delta: str | None,
    finish_reason: str | None = None,
    role: bool = False,
) -> bytes:
    """One OpenAI stream chunk (`data: {...}\\n\\n`)."""
    choice: dict[str, Any]
    if request.chat:
        message: dict[str, Any] = {}
        if role:
            message["role"] = "assistant"
        if delta is not None:
            message["content"] = delta
        choice = {"index": 0, "delta": message, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {
            "index": 0,
            "text": delta or "",
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    doc: dict[str, Any] = {
        "id": request.response_id,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [choice],
    }
    if request.include_usage:
        doc["usage"] = None
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def usage_chunk(request: TritonRequest, usage: Usage) -> bytes:
    doc: dict[str, Any] = {
        "id": request.response_id,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [],
        "usage": usage.as_dict(),
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"
