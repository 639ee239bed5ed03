"""Per model, the source of routing token ids, and the step that fills them in.

The gateway awaits `RoutingTokenizers.prepare` before the pure `schedule()` call: it
leaves the ids in `request.cache["token_ids"]` and their count in
`request.prompt_tokens`, so scorers read plain data and never do I/O themselves.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import aiohttp

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.request import LLMRequest
from servegate.tokenization.auto import AutoTokenizer
from servegate.tokenization.settings import TokenizerSettings
from servegate.tokenization.sources import (
    TOKEN_IDS_KEY,
    AsyncTokenizer,
    EngineTokenizer,
    LocalTokenizer,
    Source,
    TokenizeStats,
    local_ids,
    local_tokenizer,
)


class RoutingTokenizers:
    """Per model (or its base model), the source of token ids; built once at startup."""

    def __init__(
        self,
        default: TokenizerSettings | None = None,
        per_model: Mapping[str, TokenizerSettings] | None = None,
    ) -> None:
        self.stats = TokenizeStats()
        self._built: dict[int, Source | None] = {}
        self._async: dict[int, AsyncTokenizer] = {}
        """The sources that may do I/O, by `id`: checked once here, not per request (an
        `isinstance` against a runtime-checkable Protocol walks its members each time)."""
        self._default = self._build(default)
        self._models = {m: self._build(s) for m, s in (per_model or {}).items()}

    def _build(self, settings: TokenizerSettings | None) -> Source | None:
        if settings is None:
            return None
        key = id(settings)
        if key not in self._built:
            if settings.source == "engine":
                self._built[key] = EngineTokenizer(settings)
            elif settings.source == "auto":
                self._built[key] = AutoTokenizer(settings, self.stats)
            else:
                self._built[key] = local_tokenizer(settings.source, settings.path)
            built = self._built[key]
            if not isinstance(built, EngineTokenizer) and isinstance(built, AsyncTokenizer):
                self._async[id(built)] = built
        return self._built[key]

    @property
    def active(self) -> bool:
        return self._default is not None or any(t is not None for t in self._models.values())

    def _sources(self) -> list[Source | None]:
        return [self._default, *self._models.values()]

    def bind_session(self, session: aiohttp.ClientSession | None) -> None:
        for tok in self._sources():
            if isinstance(tok, EngineTokenizer):
                tok.session = session
            elif isinstance(tok, AsyncTokenizer):
                tok.bind_session(session)

    async def close(self) -> None:
        for tok in self._sources():
            if isinstance(tok, AsyncTokenizer):
                await tok.close()

    def status(self) -> dict[str, dict[str, Any]]:
        """Per model: where its routing ids come from (`/admin/pool`, the signals metric)."""
        out: dict[str, dict[str, Any]] = {}
        named = [("*", self._default), *self._models.items()]
        for name, tok in named:
            if tok is None:
                if name == "*":
                    out[name] = {"source": "chars", "detail": "no tokenizer"}
            elif isinstance(tok, EngineTokenizer):
                out[name] = {"source": "engine", "detail": "configured"}
            elif isinstance(tok, AsyncTokenizer):
                found = tok.status()
                out.update(found)
                if name == "*" and not found:
                    out[name] = {
                        "source": "auto",
                        "detail": "learned at each model's first request",
                    }
            else:
                out[name] = {"source": getattr(tok, "name", "local"), "detail": "configured"}
        return out

    def for_request(self, request: LLMRequest) -> Source | None:
        models = self._models
        if models:
            for name in (request.target_model, request.base_model, request.model):
                if name in models:
                    return models[name]
        return self._default

    def needs_prepare(self, request: LLMRequest) -> bool:
        """Whether `prepare` could do anything for `request`: False when its ids are there
        already, no source is configured for its model, or the source is one that has
        settled on giving none (`auto` in front of replicas with no tokenizer), so the
        caller need not create and await `prepare`'s coroutine."""
        if TOKEN_IDS_KEY in request.cache:
            return False
        tok = self.for_request(request)
        if tok is None:
            return False
        slow = self._async.get(id(tok))
        return slow is None or not slow.settled_without_ids(request)

    async def prepare(self, request: LLMRequest, candidates: Sequence[EndpointState]) -> None:
        """Put the request's token ids in `request.cache` (when a source can say them)."""
        if TOKEN_IDS_KEY in request.cache:
            return
        tok = self.for_request(request)
        if tok is None:
            return
        stats = self.stats
        slow = self._async.get(id(tok))
        if isinstance(tok, EngineTokenizer):
            ids = await tok.ids(request, candidates, stats)
        elif slow is not None:
            ids = await slow.ids(request, candidates)
            if ids is not None and request.cache.get("token_ids_partial"):
                request.cache[TOKEN_IDS_KEY] = ids
                stats.requests += 1
                return
        else:
            t0 = time.perf_counter_ns()
            ids = local_ids(cast(LocalTokenizer, tok), request)  # neither of the others
            stats.local_ns += time.perf_counter_ns() - t0
        if ids is not None:
            request.cache[TOKEN_IDS_KEY] = ids
            request.prompt_tokens = len(ids)
            stats.requests += 1
