"""Sources of routing token ids: what the engine will compute for a request, before it does.

Precise prefix scoring needs the prompt's token ids exactly as the engine will
see them. The gateway asks one of these before the pure `schedule()` call (the
`engine` and `auto` sources do I/O, which is why they live outside `scheduling/`;
`routing.py` picks the source per model). Per model, one source:

- `hf`: a HuggingFace tokenizer folder (`tokenizers`), the chat template from
  `tokenizer_config.json`, `chat_template.jinja` or `chat_template.json`
  rendered with jinja2 in a sandbox. Like vLLM, a completion prompt gets the
  tokenizer's special tokens (BOS) and a rendered template does not, unless the
  request's `add_special_tokens` says otherwise;
- `engine`: the replica's own `POST /tokenize` (vLLM, the simulator), remembered
  per request body in a bounded LRU; on failure the `fallback` source answers;
- `simulator`: servegate's built-in simulator tokenizer (`simulator.tokenizer`);
- `chars`: no ids; scorers that need them contribute nothing;
- `auto` (the default): learned per model from the replicas, prefix-cached
  (`auto.py`).

`tokenizers` and `jinja2` are imported only when an `hf` source is configured.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp
import orjson
import xxhash

from servegate import tokenizer_folder as hf_folder
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.simulator import tokenizer as sim_tokenizer
from servegate.tokenization.settings import TokenizerSettings

TOKEN_IDS_KEY = "token_ids"
CHAT_OPTIONS = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
)
"""Chat request fields that change the rendered prompt; passed to `/tokenize` as they are."""


class TokenizerError(RuntimeError):
    """A tokenizer cannot be set up; the message says how to fix it."""


class LocalTokenizer(Protocol):
    name: str

    def completion_ids(self, prompt: str, add_special_tokens: bool) -> list[int]: ...

    def chat_ids(
        self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]
    ) -> list[int]: ...


def _add_special_tokens(body: Mapping[str, Any], default: bool) -> bool:
    value = body.get("add_special_tokens")
    return value if isinstance(value, bool) else default


def completion_text(body: Mapping[str, Any]) -> str | None:
    """The one text prompt of a completion body (`"..."` or `["..."]`), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class SimulatorTokenizer:
    """The simulator's built-in tokenizer: its ids are the simulator's ids."""

    name = sim_tokenizer.BuiltinTokenizer.name

    def completion_ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return sim_tokenizer.encode(prompt)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        return sim_tokenizer.encode_chat(messages, hf_folder.add_generation_prompt(body))


def _message_for_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's "string" content format: text parts joined by newlines."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = sim_tokenizer.message_text(content)
    return out


class HFTokenizer:
    """A HuggingFace tokenizer folder with its chat template, rendered like vLLM."""

    def __init__(self, folder: str) -> None:
        path = Path(folder)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer path {folder!r}: no tokenizer.json there")
        try:
            rust = importlib.import_module("tokenizers")
        except ImportError as exc:
            raise TokenizerError(
                "an `hf` tokenizer needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        self.name = str(path)
        self._tok: Any = rust.Tokenizer.from_file(str(file))
        config = hf_folder.read_config(file.parent)
        self._special = hf_folder.special_tokens(config)
        source = hf_folder.template_source(file.parent, config)
        self._template: Any = None
        if source is not None:
            try:
                env = hf_folder.sandbox(TokenizerError)
            except ImportError as exc:
                raise TokenizerError(
                    f"{folder}: rendering its chat template needs jinja2: pip install jinja2"
                ) from exc
            self._template = env.from_string(source)

    def completion_ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=add_special_tokens).ids)

    def render(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> str:
        if self._template is None:
            raise TokenizerError(f"{self.name} has no chat template")
        return str(
            self._template.render(
                messages=[_message_for_template(m) for m in messages],
                add_generation_prompt=hf_folder.add_generation_prompt(body),
                **self._special,
                **hf_folder.template_extras(body),
            )
        )

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        text = self.render(messages, body)
        return self.completion_ids(text, _add_special_tokens(body, default=False))


def local_tokenizer(source: str, path: str | None) -> LocalTokenizer | None:
    if source == "hf":
        if path is None:
            raise TokenizerError("an `hf` tokenizer needs `path`")
        return HFTokenizer(path)
    if source == "simulator":
        return SimulatorTokenizer()
    return None


def local_ids(tok: LocalTokenizer, request: LLMRequest) -> list[int] | None:
    """The request's ids from a local tokenizer; None when it cannot say exactly."""
    body = request.body
    try:
        if request.kind is RequestKind.CHAT:
            if request.messages is None or body.get("continue_final_message"):
                return None
            if body.get("chat_template") is not None:
                return None
            return tok.chat_ids(request.messages, body)
        if request.kind is RequestKind.COMPLETION:
            text = completion_text(body)
            if text is None:
                return None
            return tok.completion_ids(text, _add_special_tokens(body, default=True))
    except (ValueError, TypeError, TokenizerError):
        return None
    return None


@dataclass(slots=True)
class TokenizeStats:
    """Tokenisation for routing, for the gateway's exporter."""

    requests: int = 0
    """Requests that got token ids."""
    local_ns: int = 0
    """Time spent in local (hf / simulator) tokenisation."""
    engine_calls: int = 0
    """`/tokenize` calls made."""
    engine_cache_hits: int = 0
    """Requests answered from the `/tokenize` cache."""
    engine_failures: int = 0
    """`/tokenize` calls that failed or timed out (the fallback answered)."""
    engine_ns: int = 0
    """Time spent waiting for `/tokenize`."""


class EngineTokenizer:
    """The replica's own `/tokenize`, cached per body hash, with a local fallback."""

    def __init__(self, settings: TokenizerSettings) -> None:
        self.settings = settings
        self.fallback = local_tokenizer(settings.fallback, settings.path)
        self.cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None

    @staticmethod
    def payload(request: LLMRequest) -> dict[str, Any] | None:
        body = request.body
        if request.kind is RequestKind.CHAT and request.messages is not None:
            out: dict[str, Any] = {
                "model": request.target_model,
                "messages": request.messages,
                "add_generation_prompt": hf_folder.add_generation_prompt(body),
            }
            for key in CHAT_OPTIONS:
                if key in body:
                    out[key] = body[key]
            return out
        if request.kind is RequestKind.COMPLETION:
            text = completion_text(body)
            if text is None:
                return None
            out = {"model": request.target_model, "prompt": text}
            if "add_special_tokens" in body:
                out["add_special_tokens"] = body["add_special_tokens"]
            return out
        return None

    async def ids(
        self, request: LLMRequest, candidates: Sequence[EndpointState], stats: TokenizeStats
    ) -> list[int] | None:
        payload = self.payload(request)
        if payload is None:
            return None
        raw = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
        key = xxhash.xxh3_128_digest(raw)
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            stats.engine_cache_hits += 1
            return cached
        ids = await self._call(raw, candidates, stats)
        if ids is None:
            stats.engine_failures += 1
            return None if self.fallback is None else local_ids(self.fallback, request)
        if self.settings.cache_size > 0:
            self.cache[key] = ids
            if len(self.cache) > self.settings.cache_size:
                self.cache.popitem(last=False)
        return ids

    async def _call(
        self, raw: bytes, candidates: Sequence[EndpointState], stats: TokenizeStats
    ) -> list[int] | None:
        if self.session is None or not candidates:
            return None
        target = min(candidates, key=lambda s: s.in_flight_requests)
        stats.engine_calls += 1
        t0 = time.perf_counter_ns()
        try:
            async with self.session.post(
                target.endpoint.url + "/tokenize",
                data=raw,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
                allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    return None
                doc = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None
        finally:
            stats.engine_ns += time.perf_counter_ns() - t0
        tokens = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            return None
        return tokens


@runtime_checkable
class AsyncTokenizer(Protocol):
    """A source that may do I/O (`auto`); the gateway awaits it before `schedule()`."""

    async def ids(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[int] | None: ...

    def settled_without_ids(self, request: LLMRequest) -> bool:
        """True only when `ids` would answer None at once (no I/O, no wait, no state moved):
        the gateway then skips awaiting it."""
        ...

    def bind_session(self, session: aiohttp.ClientSession | None) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, dict[str, Any]]: ...


Source = LocalTokenizer | EngineTokenizer | AsyncTokenizer
