"""Routing tokenisation with nothing configured: learned per model from the replicas.

`source: auto` (the pool's default) finds, the first time a model is routed, the
cheapest exact source of the engine's token ids:

1. `hf`: the replica's `/v1/models` names the model's `root` (vLLM: the model
   folder); when that folder is readable here and holds `tokenizer.json`, the
   gateway tokenises locally, chat templates included (`sources.HFTokenizer`);
2. `engine`: else the replica's own `POST /tokenize` (vLLM, SGLang, the simulator),
   probed once;
3. `chars`: else no ids (the approximate scorer hashes characters), said once.

Either way a shared prefix is tokenised once, not per request:

- text (completions; chats rendered locally) is cut into chunks of about
  `CHUNK_CHARS` characters, each cut just before a space that follows a non-space
  and precedes a letter, where byte-level BPE and SentencePiece pre-tokenisers
  always split; chunk ids are cached by the chained hash of the text up to the
  chunk's end, so two prompts that share their first N characters share every
  chunk cut before N. The assembly is checked against one whole tokenisation for
  the first `VERIFY_FIRST` multi-chunk prompts of a model and every
  `VERIFY_EVERY`-th after; one mismatch turns chunking off for that model (said once);
- engine chats are cached per conversation prefix: the ids of `messages[:k]`
  (with or without the generation prompt); a new turn is routed at once on the
  longest cached conversation prefix while the whole request is tokenised in the
  background, and the prefix property is checked when it returns.

With the engine source, a prompt whose leading chunk is cached is routed on its
cached leading ids at once; the rest is tokenised in the background for the
prompts that will extend it. Only a prompt that starts with something new waits,
for one `/tokenize` of the whole prompt (at most `CRITICAL_TIMEOUT_S`; on failure:
no ids, said once; after `BACKOFF_FAILURES` failures in a row no request waits for
`BACKOFF_S`), and its chunks are tokenised in the background.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import xxhash

from servegate import tokenizer_folder as hf_folder
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.tokenization.settings import TokenizerSettings
from servegate.tokenization.sources import (
    CHAT_OPTIONS,
    HFTokenizer,
    LocalTokenizer,
    TokenizerError,
    TokenizeStats,
    completion_text,
)

log = logging.getLogger(__name__)

CHUNK_CHARS = 512
VERIFY_FIRST = 4
VERIFY_EVERY = 256
DISCOVERY_TIMEOUT_S = 3.0
DISCOVERY_WAIT_S = 0.5
"""The longest a model's first request waits for its source to be learned."""
REDISCOVER_S = 60.0
"""A model left without a source (`chars`) is asked again after this long."""
CRITICAL_TIMEOUT_S = 0.5
"""The longest a request waits for `/tokenize` (the `timeout_s` setting, if lower)."""
BACKOFF_FAILURES = 3
BACKOFF_S = 10.0
"""After this many failed calls in a row, requests stop waiting for `/tokenize` this long
(their chunks are still tokenised in the background)."""
PARTIAL_KEY = "token_ids_partial"
"""Set on a request routed on the ids of a cached leading part of its prompt only."""
_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")
ENGINE_TOKENIZE = ("vllm", "sglang", "simulator")
"""Engine types that answer `POST /tokenize`."""


def chunk_cuts(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    """Chunk ends (exclusive), each the first safe cut at least `chunk` after the last."""
    cuts: list[int] = []
    pos = chunk
    n = len(text)
    while pos < n:
        match = _CUT.search(text, pos)
        if match is None:
            break
        cut = match.start()
        cuts.append(cut)
        pos = cut + chunk
    return cuts


@dataclass(slots=True)
class ModelStatus:
    """What one model's routing tokenisation is, for `/admin/pool` and the metric."""

    source: str = "pending"
    """`hf`, `engine`, `chars`, or `pending` until the first request of the model."""
    detail: str = ""
    chunking: bool = True
    verified: int = 0
    mismatches: int = 0
    failures: int = 0


class _Lru:
    __slots__ = ("capacity", "items")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, list[int]] = OrderedDict()

    def get(self, key: int) -> list[int] | None:
        found = self.items.get(key)
        if found is not None:
            self.items.move_to_end(key)
        return found

    def put(self, key: int, ids: list[int]) -> None:
        if self.capacity <= 0:
            return
        self.items[key] = ids
        self.items.move_to_end(key)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


def _valid_ids(doc: Any) -> list[int] | None:
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        return None
    return tokens


class ModelTokenizer:
    """One model's source of ids (local or the engine) with its prefix caches."""

    def __init__(self, model: str, settings: TokenizerSettings, stats: TokenizeStats) -> None:
        self.model = model
        self.settings = settings
        self.stats = stats
        self.status = ModelStatus()
        self.local: LocalTokenizer | None = None
        self.engine = False
        self.session: aiohttp.ClientSession | None = None
        capacity = max(settings.cache_size, 0)
        self.chunks = _Lru(capacity)
        self.convs = _Lru(capacity)
        self.seed = xxhash.xxh3_64_intdigest(model.encode())
        self._multi_chunk = 0
        self._background: set[asyncio.Task[None]] = set()
        self._pending: set[int] = set()
        self._warned: set[str] = set()
        self._ready = asyncio.Event()
        self._discovering = False
        self.chars_per_token = 4.0
        self._failures_in_row = 0
        self._skip_until = 0.0
        self._rediscover_at = float("inf")

    # -- discovery -----------------------------------------------------------------------
    async def discover(self, candidates: Sequence[EndpointState]) -> None:
        """Learn the source in the background; a request waits for it `DISCOVERY_WAIT_S` at
        most (then it routes without ids, and the next ones use what was learned)."""
        if self._ready.is_set():
            return
        if not self._discovering:
            self._discovering = True
            self._spawn(self._discover_bounded(list(candidates)))
        try:
            await asyncio.wait_for(self._ready.wait(), DISCOVERY_WAIT_S)
        except TimeoutError:
            pass

    async def _discover_bounded(self, candidates: Sequence[EndpointState]) -> None:
        try:
            await asyncio.wait_for(self._discover(candidates), DISCOVERY_TIMEOUT_S * 2)
        except TimeoutError:
            self._settle("chars", "discovery timed out")
        finally:
            if not self._ready.is_set():
                self._settle("chars", "discovery failed")
            self._discovering = False
            if self.status.source == "chars":
                self._rediscover_at = time.monotonic() + REDISCOVER_S

    def settled_without_ids(self) -> bool:
        """Whether `ids` would answer None at once: the model settled on no source (`chars`)
        and is not due to be asked again. The common case with nothing configured in front
        of replicas that expose no tokenizer; checked without a coroutine per request."""
        return (
            self.status.source == "chars"
            and self._ready.is_set()
            and time.monotonic() < self._rediscover_at
        )

    def _maybe_rediscover(self) -> None:
        """A model found without a source is asked again now and then (a replica that
        was down, or started later)."""
        if self.status.source == "chars" and time.monotonic() >= self._rediscover_at:
            self._rediscover_at = float("inf")
            self._ready.clear()

    def _settle(self, source: str, detail: str) -> None:
        self.status.source = source
        self.status.detail = detail
        self._ready.set()
        if source == "chars":
            self.warn_once(
                "no-source",
                f"routing tokenizer for model {self.model!r}: none ({detail}); prefix routing "
                "hashes characters, which do not line up with the engine's token blocks",
            )
        else:
            log.info("routing tokenizer for model %r: %s (%s)", self.model, source, detail)

    async def _discover(self, candidates: Sequence[EndpointState]) -> None:
        session = self.session
        if session is None or not candidates:
            self._settle("chars", "no replica to ask")
            return
        state = candidates[0]
        root = await self._model_root(session, state)
        if root is not None:
            try:
                self.local = HFTokenizer(root)
            except (TokenizerError, OSError, ValueError) as exc:
                log.debug("model %r root %s not usable: %s", self.model, root, exc)
            else:
                self._settle("hf", f"tokenizer files at {root}")
                return
        if state.endpoint.engine in ENGINE_TOKENIZE:
            ids = await self._tokenize(
                state,
                {"model": self.model, "prompt": "hello world", "add_special_tokens": False},
                probe=True,
            )
            if ids is not None:
                self.engine = True
                self._settle("engine", f"POST /tokenize ({state.endpoint.engine})")
                return
            self._settle("chars", f"{state.address}/tokenize did not answer with token ids")
            return
        self._settle("chars", f"engine type {state.endpoint.engine!r} has no /tokenize")

    async def _model_root(self, session: aiohttp.ClientSession, state: EndpointState) -> str | None:
        try:
            async with session.get(
                state.endpoint.url + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    return None
                doc = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
            return None
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            return None
        for entry in data:
            if isinstance(entry, dict) and entry.get("id") == self.model:
                root = entry.get("root")
                if isinstance(root, str) and root and (Path(root) / "tokenizer.json").is_file():
                    return root
        return None

    # -- engine calls -----------------------------------------------------------------
    def waiting_allowed(self) -> bool:
        return time.monotonic() >= self._skip_until

    async def _tokenize(
        self,
        state: EndpointState,
        payload: Mapping[str, Any],
        *,
        critical: bool = False,
        probe: bool = False,
    ) -> list[int] | None:
        session = self.session
        if session is None:
            return None
        timeout = self.settings.timeout_s
        if critical:
            timeout = min(timeout, CRITICAL_TIMEOUT_S)
        self.stats.engine_calls += 1
        t0 = time.perf_counter_ns()
        try:
            async with session.post(
                state.endpoint.url + "/tokenize",
                data=orjson.dumps(payload),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    if not probe:
                        self._failed(f"/tokenize answered {resp.status}")
                    return None
                doc = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
            if not probe:
                self._failed(f"/tokenize failed: {type(exc).__name__}")
            return None
        finally:
            self.stats.engine_ns += time.perf_counter_ns() - t0
        ids = _valid_ids(doc)
        if ids is None:
            if not probe:
                self._failed("/tokenize answered without a list of token ids")
            return None
        self._failures_in_row = 0
        return ids

    def _failed(self, why: str) -> None:
        self.stats.engine_failures += 1
        self.status.failures += 1
        self._failures_in_row += 1
        if self._failures_in_row >= BACKOFF_FAILURES:
            self._skip_until = time.monotonic() + BACKOFF_S
        self.warn_once(why, f"routing tokenizer for model {self.model!r}: {why}; "
                       "requests it fails for route on character blocks")  # fmt: skip
        return None

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- text: chunked ---------------------------------------------------------------
    def _plan(self, text: str, add_special: bool) -> list[tuple[int, int, int]]:
        """(key, start, end) per chunk; the key chains the text up to the chunk's end."""
        cuts = chunk_cuts(text) if self.status.chunking else []
        cuts.append(len(text))
        prev = self.seed ^ (1 if add_special else 0)
        start = 0
        out = []
        for end in cuts:
            prev = xxhash.xxh3_64_intdigest(text[start:end].encode("utf-8", "surrogatepass"), prev)
            out.append((prev, start, end))
            start = end
        return out

    def _local_text(self, text: str, add_special: bool) -> list[int]:
        assert self.local is not None
        plan = self._plan(text, add_special)
        ids: list[int] = []
        for i, (key, start, end) in enumerate(plan):
            got = self.chunks.get(key)
            if got is None:
                got = self.local.completion_ids(text[start:end], add_special and i == 0)
                self.chunks.put(key, got)
            else:
                self.stats.engine_cache_hits += 1
            ids.extend(got)
        if len(plan) > 1 and self._verify_due():
            whole = self.local.completion_ids(text, add_special)
            self._check(whole, ids, exact=True)
            return whole
        return ids

    def _verify_due(self) -> bool:
        self._multi_chunk += 1
        n = self._multi_chunk
        return n <= VERIFY_FIRST or n % VERIFY_EVERY == 0

    def _check(self, whole: list[int], assembled: Sequence[int], *, exact: bool) -> None:
        ok = whole == list(assembled) if exact else whole[: len(assembled)] == list(assembled)
        if ok:
            self.status.verified += 1
            return
        self.status.mismatches += 1
        if self.status.chunking:
            self.status.chunking = False
            self.chunks.items.clear()
            self.convs.items.clear()
            self.warn_once(
                "mismatch",
                f"routing tokenizer for model {self.model!r}: prefix-cached ids differ from a "
                "whole tokenisation; prefix caching is off for this model (every prompt is "
                "tokenised whole)",
            )

    async def _engine_text(
        self, text: str, add_special: bool, state: EndpointState, request: LLMRequest
    ) -> list[int] | None:
        plan = self._plan(text, add_special)
        cached: list[list[int] | None] = [self.chunks.get(key) for key, _, _ in plan]
        lead = 0
        while lead < len(plan) and cached[lead] is not None:
            lead += 1
        if lead == len(plan):
            self.stats.engine_cache_hits += 1
            return [t for part in cached if part is not None for t in part]
        if lead > 0:
            # route now on the cached leading chunks; the rest is for later prompts
            ids = [t for part in cached[:lead] if part is not None for t in part]
            missing = [(i, plan[i]) for i in range(lead, len(plan)) if cached[i] is None]
            self._spawn(self._fill(text, add_special, missing, state, verify=None))
            rest = len(text) - plan[lead - 1][2]
            request.cache[PARTIAL_KEY] = True
            request.prompt_tokens = len(ids) + int(rest / self.chars_per_token)
            self.stats.engine_cache_hits += 1
            return ids
        missing = [(i, plan[i]) for i in range(len(plan)) if cached[i] is None]
        if not self.waiting_allowed():
            self._spawn(self._fill(text, add_special, missing, state, verify=None))
            return None
        # a new start: one call for the whole prompt now, its chunks in the background
        whole = await self._tokenize(
            state,
            {"model": self.model, "prompt": text, "add_special_tokens": add_special},
            critical=True,
        )
        if whole is None:
            return None
        if whole:
            self.chars_per_token = 0.9 * self.chars_per_token + 0.1 * (len(text) / len(whole))
        if len(plan) > 1:
            check = whole if self._verify_due() else None
            self._spawn(self._fill(text, add_special, missing, state, verify=check))
        elif self.status.chunking:
            self.chunks.put(plan[0][0], whole)
        return whole

    async def _fetch(
        self,
        text: str,
        add_special: bool,
        missing: Sequence[tuple[int, tuple[int, int, int]]],
        state: EndpointState,
        critical: bool = False,
    ) -> dict[int, list[int]] | None:
        async def one(i: int, start: int, end: int) -> list[int] | None:
            return await self._tokenize(
                state,
                {
                    "model": self.model,
                    "prompt": text[start:end],
                    "add_special_tokens": add_special and i == 0,
                },
                critical=critical,
            )

        results = await asyncio.gather(*(one(i, s, e) for i, (_, s, e) in missing))
        out: dict[int, list[int]] = {}
        for (i, (key, _, _)), got in zip(missing, results, strict=True):
            if got is None:
                return None
            self.chunks.put(key, got)
            out[i] = got
        return out

    async def _fill(
        self,
        text: str,
        add_special: bool,
        missing: Sequence[tuple[int, tuple[int, int, int]]],
        state: EndpointState,
        verify: list[int] | None,
    ) -> None:
        todo = [(i, p) for i, p in missing if p[0] not in self._pending]
        keys = {p[0] for _, p in todo}
        self._pending.update(keys)
        try:
            await self._fetch(text, add_special, todo, state)
        finally:
            self._pending.difference_update(keys)
        if verify is not None:
            parts = [self.chunks.get(key) for key, _, _ in self._plan(text, add_special)]
            if all(p is not None for p in parts):
                self._check(verify, [t for p in parts if p is not None for t in p], exact=True)

    # -- chats on the engine: conversation prefixes ---------------------------------------
    def _conv_key(self, messages: Sequence[Any], gen: bool, options: bytes) -> int:
        raw = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)
        return xxhash.xxh3_64_intdigest(raw + options + (b"\x01" if gen else b"\x00"), self.seed)

    async def _engine_chat(self, request: LLMRequest, state: EndpointState) -> list[int] | None:
        messages = request.messages or []
        body = request.body
        gen = hf_folder.add_generation_prompt(body)
        extras = {k: body[k] for k in CHAT_OPTIONS if k in body}
        options = orjson.dumps(extras, option=orjson.OPT_SORT_KEYS)
        full_key = self._conv_key(messages, gen, options)
        got = self.convs.get(full_key)
        if got is not None:
            self.stats.engine_cache_hits += 1
            return got

        def payload(msgs: Sequence[Any], g: bool) -> dict[str, Any]:
            return {"model": self.model, "messages": list(msgs), "add_generation_prompt": g,
                    **extras}  # fmt: skip

        prefix: list[int] | None = None
        if self.status.chunking:
            for k in range(len(messages) - 1, 0, -1):
                for g in (True, False):
                    prefix = self.convs.get(self._conv_key(messages[:k], g, options))
                    if prefix is not None:
                        break
                if prefix is not None:
                    break
        head = messages[:-1]
        head_key = self._conv_key(head, False, options) if head else None
        if prefix is not None:
            self.stats.engine_cache_hits += 1
            request.cache[PARTIAL_KEY] = True
            tail_chars = sum(len(str(m.get("content", ""))) for m in messages[-1:])
            request.prompt_tokens = len(prefix) + int(tail_chars / self.chars_per_token)
            self._spawn(self._chat_background(payload(messages, gen), full_key, prefix, state))
            if head_key is not None and self.convs.get(head_key) is None:
                self._spawn(self._chat_background(payload(head, False), head_key, None, state))
            return prefix
        if not self.waiting_allowed():
            self._spawn(self._chat_background(payload(messages, gen), full_key, None, state))
            return None
        ids = await self._tokenize(state, payload(messages, gen), critical=True)
        if ids is None:
            return None
        self.convs.put(full_key, ids)
        if head_key is not None and self.status.chunking:
            self._spawn(self._chat_background(payload(head, False), head_key, ids, state))
        return ids

    async def _chat_background(
        self, payload: dict[str, Any], key: int, other: list[int] | None, state: EndpointState
    ) -> None:
        """Tokenise `payload` for the cache; `other` is its prefix (or it is `other`'s)."""
        if key in self._pending:
            return
        self._pending.add(key)
        try:
            ids = await self._tokenize(state, payload)
        finally:
            self._pending.discard(key)
        if ids is None:
            return
        if other is not None:
            short, long = (ids, other) if len(ids) <= len(other) else (other, ids)
            self._check(long, short, exact=False)
            if not self.status.chunking:
                return
        self.convs.put(key, ids)

    # -- the request --------------------------------------------------------------------
    async def ids(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[int] | None:
        self._maybe_rediscover()
        if not self._ready.is_set():
            await self.discover(candidates)
        source = self.status.source
        body = request.body
        if source == "hf":
            t0 = time.perf_counter_ns()
            try:
                return self._local(request)
            finally:
                self.stats.local_ns += time.perf_counter_ns() - t0
        if source != "engine" or not candidates:
            return None
        state = min(candidates, key=lambda s: s.in_flight_requests)
        if request.kind is RequestKind.COMPLETION:
            text = completion_text(body)
            if text is None:
                return None
            add = body.get("add_special_tokens")
            return await self._engine_text(
                text, add if isinstance(add, bool) else True, state, request
            )
        if request.kind is RequestKind.CHAT and request.messages:
            if body.get("continue_final_message"):
                return None
            return await self._engine_chat(request, state)
        return None

    def _local(self, request: LLMRequest) -> list[int] | None:
        tok = self.local
        assert isinstance(tok, HFTokenizer)
        body = request.body
        try:
            if request.kind is RequestKind.COMPLETION:
                text = completion_text(body)
                if text is None:
                    return None
                add = body.get("add_special_tokens")
                return self._local_text(text, add if isinstance(add, bool) else True)
            if request.kind is RequestKind.CHAT and request.messages is not None:
                if body.get("continue_final_message") or body.get("chat_template") is not None:
                    return None
                rendered = tok.render(request.messages, body)
                add = body.get("add_special_tokens")
                return self._local_text(rendered, add if isinstance(add, bool) else False)
        except (ValueError, TypeError, TokenizerError):
            return None
        return None


@dataclass(slots=True)
class AutoTokenizer:
    """`source: auto`: one `ModelTokenizer` per base model, discovered on first use."""

    settings: TokenizerSettings
    stats: TokenizeStats
    models: dict[str, ModelTokenizer] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None

    def for_model(self, model: str) -> ModelTokenizer:
        tok = self.models.get(model)
        if tok is None:
            tok = self.models[model] = ModelTokenizer(model, self.settings, self.stats)
            tok.session = self.session
        return tok

    def bind_session(self, session: aiohttp.ClientSession | None) -> None:
        self.session = session
        for tok in self.models.values():
            tok.session = session

    async def ids(
        self, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> list[int] | None:
        return await self.for_model(request.base_model).ids(request, candidates)

    def settled_without_ids(self, request: LLMRequest) -> bool:
        """Whether `ids` would answer None at once for `request`'s model (see
        `ModelTokenizer.settled_without_ids`); False for a model not seen yet."""
        tok = self.models.get(request.base_model)
        return tok is not None and tok.settled_without_ids()

    async def close(self) -> None:
        for tok in self.models.values():
            await tok.close()

    def status(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "source": tok.status.source,
                "detail": tok.status.detail,
                "prefix_cache": tok.status.chunking,
                "verified": tok.status.verified,
                "mismatches": tok.status.mismatches,
                "failures": tok.status.failures,
            }
            for name, tok in self.models.items()
        }
