"""Token counts for Triton models, with the tokenizer learned from Triton's model configuration.

Triton's generate API returns text, not token ids, so `usage` is counted here. A
pool's `tokenizer` setting (`hf`, `simulator`), when there is one, counts. Without
one, `TritonTokenCounts` learns each model's tokenizer, once per pool and model, in
the background:

1. `GET /v2/models/{name}/config` (the model configuration extension: the
   `ModelConfig` protobuf as JSON, field names as in `model_config.proto`);
2. its `parameters.tokenizer_dir.string_value`, else, for an ensemble, that of
   the first step in `ensemble_scheduling.step[*].model_name` that has one, else
   that of `preprocessing` (the name TensorRT-LLM's `tensorrt_llm_bls` calls);
3. that folder, when readable from the gateway, loaded as an `HFTokenizer`. The
   same config's `add_special_tokens` (TensorRT-LLM's preprocessing reads it as a
   boolean string, true when absent or unreadable) says whether the prompt's
   count includes the special tokens (BOS) the preprocessing model adds.

No request waits for this: until it is learned, and whenever it cannot be,
`usage` is the one-token-per-four-characters estimate. A model that could not be
learned is asked again after 5 s, doubling up to 300 s; the first failure is
logged once as a warning, later ones only at debug.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from servegate.config import PoolSettings
from servegate.tokenization.sources import HFTokenizer, LocalTokenizer, TokenizerError

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
PREPROCESSING = "preprocessing"
"""The preprocessing model `tensorrt_llm_bls` calls (it is no ensemble step to follow)."""
CONFIG_TIMEOUT_S = 3.0
BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0
MAX_MODELS = 1024
"""Models learned per pool at most: the name comes from the client; beyond it, estimates."""
TRUE_STRINGS = ("true", "1", "t", "y", "yes")
BOOL_STRINGS = (*TRUE_STRINGS, "false", "0", "f", "n", "no")


class TokenCounter:
    """Counts tokens with a local tokenizer when there is one, else estimates.

    `add_special_tokens`, when set, is what the engine does to every prompt (Triton's
    preprocessing model); unset, the caller says (vLLM's rule: completions yes, chats no).
    """

    def __init__(
        self,
        tokenizer: LocalTokenizer | None = None,
        add_special_tokens: bool | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.source = "tokenizer" if tokenizer is not None else "estimate"

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        if self._tokenizer is None:
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        return len(self._tokenizer.completion_ids(text, add_special_tokens))

    def count_prompt(self, text: str, chat: bool) -> int:
        special = self.add_special_tokens
        return self.count(text, add_special_tokens=not chat if special is None else special)


ESTIMATE = TokenCounter()


class TritonConfigError(RuntimeError):
    """The model's tokenizer cannot be learned; the message says why."""


@dataclass(frozen=True, slots=True)
class TokenizerDir:
    """Where Triton's model configuration says a model's tokenizer is."""

    path: str
    add_special_tokens: bool
    model: str
    """The Triton model whose parameters named it (`preprocessing`, or the model itself)."""


def _parameter(config: Mapping[str, Any], key: str) -> str | None:
    params = config.get("parameters")
    entry = params.get(key) if isinstance(params, Mapping) else None
    value = entry.get("string_value") if isinstance(entry, Mapping) else None
    if not isinstance(value, str) or not value or value.startswith("${"):
        return None  # absent, or a template placeholder never filled in
    return value


def tokenizer_dir(config: Mapping[str, Any], model: str) -> TokenizerDir | None:
    """The `tokenizer_dir` parameter of one model's configuration, if it has one."""
    path = _parameter(config, "tokenizer_dir")
    if path is None:
        return None
    special = (_parameter(config, "add_special_tokens") or "true").lower()
    add = special in TRUE_STRINGS if special in BOOL_STRINGS else True
    return TokenizerDir(path, add, model)


def ensemble_steps(config: Mapping[str, Any]) -> list[str]:
    """The model names of an ensemble's steps, in order; [] for any other model."""
    scheduling = config.get("ensemble_scheduling")
    steps = scheduling.get("step") if isinstance(scheduling, Mapping) else None
    if not isinstance(steps, list):
        return []
    names = [s.get("model_name") for s in steps if isinstance(s, Mapping)]
    return [n for n in names if isinstance(n, str) and n]


async def fetch_config(session: aiohttp.ClientSession, base_url: str, model: str) -> dict[str, Any]:
    """One model's configuration; raises `TritonConfigError`."""
    url = f"{base_url}/v2/models/{quote(model, safe='')}/config"
    try:
        async with session.get(
            url, timeout=aiohttp.ClientTimeout(total=CONFIG_TIMEOUT_S), allow_redirects=False
        ) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TritonConfigError(f"GET {url} failed: {type(exc).__name__}") from exc
    if status != 200:
        raise TritonConfigError(f"GET {url} answered {status}")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TritonConfigError(f"GET {url} answered something that is not JSON") from exc
    if not isinstance(doc, dict):
        raise TritonConfigError(f"GET {url} answered JSON that is not a model configuration")
    return doc


async def find_tokenizer_dir(
    session: aiohttp.ClientSession, base_url: str, model: str
) -> TokenizerDir:
    """Where `model`'s tokenizer is, per the module docstring; raises `TritonConfigError`."""
    config = await fetch_config(session, base_url, model)
    found = tokenizer_dir(config, model)
    if found is not None:
        return found
    steps = ensemble_steps(config)
    asked = {model}
    for name in [*steps, PREPROCESSING]:
        if name in asked:
            continue
        asked.add(name)
        try:
            step = await fetch_config(session, base_url, name)
        except TritonConfigError:
            if name in steps:
                raise
            continue
        found = tokenizer_dir(step, name)
        if found is not None:
            return found
    kind = "ensemble" if steps else "model"
    raise TritonConfigError(
        f"no `tokenizer_dir` parameter in the configuration of {kind} {model!r}, "
        f"its steps or {PREPROCESSING!r}"
    )


@dataclass(slots=True)
class ModelCount:
    """One model's token counting, for `/admin/pool` and the routing-signal gauge."""

    source: str = "pending"
    """`tokenizer` (learned), `estimate` (not learned: characters / 4), or `pending`."""
    detail: str = ""
    failures: int = 0
    counter: TokenCounter | None = None
    retry_at: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class TritonTokenCounts:
    """Per model of one pool: its learned token counter (see the module docstring).

    Owned by the pool's live state, so what was learned survives picker reloads.
    """

    def __init__(
        self,
        configured: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.models: dict[str, ModelCount] = {}
        self.clock = clock
        self.configured = dict(configured or {})
        """Model (or `*`) → the tokenizer the pool's settings name; shown, never learned."""
        self.session: aiohttp.ClientSession | None = None

    @classmethod
    def from_pool(cls, settings: PoolSettings) -> TritonTokenCounts:
        configured: dict[str, str] = {}
        for name, tok in [
            ("*", settings.tokenizer),
            *((m.id, m.tokenizer) for m in settings.models),
        ]:
            if tok is None:
                continue
            source = tok.local_source
            if source in ("hf", "simulator"):
                configured[name] = tok.path if source == "hf" and tok.path else source
        return cls(configured)

    def bind_session(self, session: aiohttp.ClientSession | None) -> None:
        self.session = session

    def counter(self, model: str, base_url: str, triton_model: str) -> TokenCounter | None:
        """The learned counter of `model`, else None; learning starts (or retries) when due.

        Never waits: the caller estimates until a counter is learned."""
        entry = self.models.get(model)
        if entry is None:
            if len(self.models) >= MAX_MODELS:
                return None
            entry = self.models[model] = ModelCount()
        if entry.counter is not None:
            return entry.counter
        if entry.task is None and self.session is not None and self.clock() >= entry.retry_at:
            task = asyncio.get_running_loop().create_task(
                self._learn(model, entry, self.session, base_url, triton_model)
            )
            entry.task = task
        return None

    async def _learn(
        self,
        model: str,
        entry: ModelCount,
        session: aiohttp.ClientSession,
        base_url: str,
        triton_model: str,
    ) -> None:
        try:
            found = await find_tokenizer_dir(session, base_url, triton_model)
            try:
                local = await asyncio.to_thread(HFTokenizer, found.path)
            except (TokenizerError, OSError, ValueError) as exc:
                raise TritonConfigError(
                    f"{found.model!r} names tokenizer_dir {found.path!r}, which the gateway "
                    f"cannot load: {exc}"
                ) from exc
        except TritonConfigError as exc:
            self._failed(model, entry, str(exc))
        else:
            entry.counter = TokenCounter(local, found.add_special_tokens)
            entry.source = "tokenizer"
            entry.detail = found.path
            log.info(
                "Triton model %r: usage counted with the tokenizer at %s (from %r's config)",
                model,
                found.path,
                found.model,
            )
        finally:
            entry.task = None

    def _failed(self, model: str, entry: ModelCount, why: str) -> None:
        entry.failures += 1
        delay = min(BACKOFF_FIRST_S * 2 ** (entry.failures - 1), BACKOFF_MAX_S)
        entry.retry_at = self.clock() + delay
        entry.source = "estimate"
        entry.detail = why
        if entry.failures == 1:
            log.warning(
                "Triton model %r: usage is estimated (characters / %d): %s; asked again "
                "with back-off up to %.0f s",
                model,
                CHARS_PER_TOKEN,
                why,
                BACKOFF_MAX_S,
            )
        else:
            log.debug("Triton model %r: tokenizer not learned (%s): %s", model, entry.failures, why)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per model: where its Triton token counts come from."""
        out: dict[str, dict[str, Any]] = {
            name: {"source": "tokenizer", "detail": f"configured: {what}"}
            for name, what in self.configured.items()
        }
        for name, entry in self.models.items():
            if name not in out:
                out[name] = {
                    "source": entry.source,
                    "detail": entry.detail,
                    "failures": entry.failures,
                }
        return out

    async def close(self) -> None:
        tasks = [e.task for e in self.models.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
