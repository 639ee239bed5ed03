"""The simulated engine: vLLM v1's continuous-batching scheduler on a virtual clock.

One asyncio task runs steps. Each step it schedules like vLLM's v1 `Scheduler`:
running requests first (one decode token each, or the next chunk of a long
prompt), preempting the most recently admitted request when no KV block is free;
then waiting requests in arrival order while there are token budget
(`max_num_batched_tokens`), sequence slots (`max_num_seqs`) and blocks. A waiting
request looks its prompt up in the prefix cache the first time it is
considered (and again after a preemption). A request for a LoRA adapter is
passed over while the step already needs `max_loras` other adapters.

The step then lasts

    (step_overhead_s + prefill_token_s * uncached prompt tokens computed
     + decode_seq_s * decoding sequences + activation_latency_s * adapters loaded)
    / speed * slow_factor

of wall time (one `asyncio.sleep`), after which every scheduled request whose
prompt is complete gets one token. Handlers are woken once per step with all
the text produced for them. TTFT, inter-token latency and throughput therefore
come out of the load, as on a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from servegate.simulator.config import SimConfig
from servegate.simulator.kv_cache import KVCache, KVEvent, SeqBlocks, block_hashes_of
from servegate.simulator.lora import Adapter, LoraRegistry
from servegate.simulator.stats import EngineStats
from servegate.simulator.tokenizer import StreamDecoder, Tokenizer

_MASK64 = (1 << 64) - 1
_POOL_SIZE = 8192


class RequestError(Exception):
    """A request the engine refuses; rendered as the persona's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


class EventSink(Protocol):
    def publish(self, events: Sequence[KVEvent], ts: float) -> None: ...


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_len: int
    token_ids: list[int]
    """Prompt then output tokens."""
    max_tokens: int
    planned_tokens: int
    """Output length at which the model emits EOS (>= max_tokens: never)."""
    min_tokens: int
    stop: tuple[str, ...]
    include_stop: bool
    lora: Adapter | None
    arrival: float
    decoder: StreamDecoder
    output_offset: int
    do_remote_decode: bool = False
    remote_tokens: int = 0
    """Decode side of P/D: prompt tokens whose KV arrives from the prefill server."""
    seq: SeqBlocks = field(default_factory=SeqBlocks)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    """Output text released to the client, in pieces."""
    taken: int = 0
    held: str = ""
    cached_tokens: int = -1
    """Prompt tokens not computed here (prefix hits + remote KV); -1 before scheduling."""
    first_scheduled: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    aborted: bool = False
    wants_stream: bool = False
    """Wake the handler every step (streaming), not only at the end."""
    _waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.released)

    def take_text(self) -> str:
        """Text released since the last call (for streaming)."""
        if self.taken == len(self.released):
            return ""
        new = "".join(self.released[self.taken :])
        self.taken = len(self.released)
        return new

    def has_news(self) -> bool:
        return self.taken < len(self.released) or self.finish_reason is not None

    async def wait(self) -> None:
        """Until there is text to take or the request finished."""
        if self.has_news():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _notify(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True)
class _Scheduled:
    req: SimRequest
    num_new: int
    prefill: bool


class Engine:
    def __init__(
        self,
        cfg: SimConfig,
        tokenizer: Tokenizer,
        events: EventSink | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.events = events
        self._clock = clock or time.monotonic
        self.kv = KVCache(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.lora: LoraRegistry | None = (
            LoraRegistry(cfg.lora.max_loras, cfg.lora.adapter_paths()) if cfg.lora.enabled else None
        )
        self.stats = EngineStats.for_model_len(cfg.max_model_len)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.slow_factor = 1.0
        self.engine_id = cfg.engine_id or f"{cfg.model}@{cfg.host}:{cfg.port}"
        self.advertised_host = cfg.host
        self.advertised_port = cfg.port
        self._root_hash = (cfg.seed * 0x9E3779B97F4A7C15 + 0x5EED) & _MASK64
        rng = random.Random(cfg.seed)
        source = list(tokenizer.output_token_ids())
        self._pool = [rng.choice(source) for _ in range(_POOL_SIZE)] if source else [0]
        if self.lora is not None:
            self._record_lora()
        self._wake = asyncio.Event()
        self._running_gate = asyncio.Event()
        self._running_gate.set()
        self._task: asyncio.Task[None] | None = None
        self._dead = False

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("abort")

    def kill(self) -> None:
        """Stop stepping at once and abort every request (a crash)."""
        self._dead = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._fail_all("abort")

    @property
    def alive(self) -> bool:
        return not self._dead

    def pause(self) -> None:
        """Stop stepping; requests in flight stall (a hang)."""
        self._running_gate.clear()

    def resume(self) -> None:
        self._running_gate.set()

    @property
    def paused(self) -> bool:
        return not self._running_gate.is_set()

    def advertise(self, host: str, port: int) -> None:
        """Where P/D decode servers reach this one (`remote_host`, `remote_port`)."""
        self.advertised_host = host
        self.advertised_port = port
        if self.cfg.engine_id is None:
            self.engine_id = f"{self.cfg.model}@{host}:{port}"

    # -- requests ----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def resolve_lora(self, model: str | None) -> Adapter | None:
        """The adapter a `model` field names; None for the base model."""
        if model is None or model == self.cfg.model or self.lora is None:
            return None
        return self.lora.get(model)

    def submit(
        self,
        prompt_ids: list[int],
        *,
        request_id: str,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        ignore_eos: bool = False,
        lora: Adapter | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> SimRequest:
        if self._dead:
            raise RequestError("The engine is dead.", 500, "InternalServerError")
        n = len(prompt_ids)
        limit = self.cfg.max_model_len
        if n == 0:
            raise RequestError("The decoder prompt cannot be empty", param="prompt")
        if n >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages.",
                param="input_tokens",
            )
        if max_tokens is not None:
            if max_tokens < 1:
                raise RequestError(
                    f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens"
                )
            if n + max_tokens > limit:
                raise RequestError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                    f"model's maximum context length is {limit} tokens and your request has {n} "
                    f"input tokens ({max_tokens} > {limit} - {n}).",
                    param="max_tokens",
                )
            resolved = max_tokens
        else:
            resolved = limit - n
            if self.cfg.output.default_max_tokens is not None:
                resolved = min(resolved, self.cfg.output.default_max_tokens)
        if min_tokens < 0 or min_tokens > resolved:
            raise RequestError(
                f"min_tokens must be between 0 and max_tokens={resolved}, got {min_tokens}.",
                param="min_tokens",
            )
        key = hash((self.cfg.seed, n, tuple(prompt_ids[:256]), tuple(prompt_ids[-256:])))
        planned = resolved
        p = self.cfg.output.eos_probability
        if p > 0 and not ignore_eos:
            u = random.Random(key).random()
            planned = max(min_tokens, 1 + int(math.log(1.0 - u) / math.log(1.0 - p)))
        req = SimRequest(
            request_id=request_id,
            prompt_len=n,
            token_ids=list(prompt_ids),
            max_tokens=resolved,
            planned_tokens=planned,
            min_tokens=min_tokens,
            stop=tuple(s for s in stop if s),
            include_stop=include_stop,
            lora=lora,
            arrival=self._clock(),
            decoder=self.tokenizer.stream_decoder(),
            output_offset=key % len(self._pool),
        )
        if lora is not None:
            req.seq.lora_id = lora.lora_id
            req.seq.lora_name = lora.name
        if kv_transfer_params:
            role = self.cfg.role
            if kv_transfer_params.get("do_remote_decode") and role != "decode":
                req.do_remote_decode = True
            if kv_transfer_params.get("do_remote_prefill") and role != "prefill":
                block_ids = kv_transfer_params.get("remote_block_ids") or []
                if isinstance(block_ids, list):
                    req.remote_tokens = min(len(block_ids) * self.cfg.block_size, n)
        self.stats.requests_received += 1
        self.waiting.append(req)
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """The client went away: free everything the request holds."""
        if req.finished:
            return
        req.aborted = True
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.kv.free(req.seq)
        self._finish(req, "abort", self._clock())
        self._publish()

    # -- the step loop -----------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            if not self._running_gate.is_set():
                await self._running_gate.wait()
            started = loop.time()
            plan, loras_loaded = self._schedule()
            if not plan:
                self._publish()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), timeout=self.cfg.costs.step_overhead_s + 0.001
                    )
                continue
            duration = self._step_duration(plan, loras_loaded)
            delay = started + duration - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            if not self._running_gate.is_set():
                await self._running_gate.wait()
            self._complete(plan, self._clock())
            self.stats.steps += 1
            self.stats.last_step_s = duration
            self.stats.busy_s += duration

    def _step_duration(self, plan: list[_Scheduled], loras_loaded: int) -> float:
        costs = self.cfg.costs
        prefill_tokens = 0
        decodes = 0
        for item in plan:
            if item.prefill:
                prefill_tokens += item.num_new
            else:
                decodes += 1
        seconds = (
            costs.step_overhead_s
            + costs.prefill_token_s * prefill_tokens
            + costs.decode_seq_s * decodes
            + self.cfg.lora.activation_latency_s * loras_loaded
        )
        return seconds / self.cfg.speed * self.slow_factor

    def step_now(self) -> list[SimRequest]:
        """Schedule and complete one step without sleeping (tests drive the engine
        this way); `stats.last_step_s` gets the duration the step would have had."""
        plan, loras_loaded = self._schedule()
        if plan:
            self.stats.last_step_s = self._step_duration(plan, loras_loaded)
            self.stats.busy_s += self.stats.last_step_s
        self._complete(plan, self._clock())
        self.stats.steps += 1
        return [item.req for item in plan]

    def _schedule(self) -> tuple[list[_Scheduled], int]:
        cfg = self.cfg
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        plan: list[_Scheduled] = []
        step_loras: set[int] = set()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(len(req.token_ids) - req.num_computed, budget)
            if num_new <= 0:
                i += 1
                continue
            while not kv.allocate(req.seq, req.num_computed, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._cache_blocks(req, req.num_computed + num_new)
                plan.append(_Scheduled(req, num_new, req.num_computed < req.prompt_len))
                budget -= num_new
                if req.lora is not None:
                    step_loras.add(req.lora.lora_id)
                i += 1
                continue
            break

        if not preempted:
            skipped: list[SimRequest] = []
            max_loras = cfg.lora.max_loras
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                if (
                    req.lora is not None
                    and req.lora.lora_id not in step_loras
                    and len(step_loras) >= max_loras
                ):
                    skipped.append(self.waiting.popleft())
                    continue
                num_tokens = len(req.token_ids)
                hits = []
                if req.num_computed == 0:
                    self._extend_hashes(req, num_tokens)
                    hits = kv.find_cached_prefix(req.block_hashes, num_tokens)
                    self.stats.prefix_cache_queries += num_tokens
                    self.stats.prefix_cache_hits += len(hits) * cfg.block_size
                local = len(hits) * cfg.block_size
                external = 0
                if req.num_computed == 0 and req.remote_tokens:
                    external = max(0, min(req.remote_tokens, num_tokens - 1) - local)
                num_new = num_tokens - req.num_computed - local - external
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if not kv.allocate(req.seq, req.num_computed + local, external + num_new, hits):
                    break
                self.waiting.popleft()
                if req.cached_tokens < 0:
                    req.cached_tokens = local + external
                    req.first_scheduled = self._clock()
                    self.stats.cached_prompt_tokens += local + external
                req.num_computed += local + external
                self._cache_blocks(req, req.num_computed + num_new)
                self.running.append(req)
                plan.append(_Scheduled(req, num_new, req.num_computed < req.prompt_len))
                budget -= num_new
                if req.lora is not None:
                    step_loras.add(req.lora.lora_id)
            if skipped:
                self.waiting.extendleft(reversed(skipped))

        loaded = 0
        if self.lora is not None and plan:
            loaded = self.lora.activate(
                item.req.lora.lora_id for item in plan if item.req.lora is not None
            )
        if plan:
            self.stats.iteration_tokens.observe(sum(item.num_new for item in plan))
        return plan, loaded

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.seq)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _extend_hashes(self, req: SimRequest, num_tokens: int) -> None:
        bs = self.cfg.block_size
        if len(req.block_hashes) * bs + bs > num_tokens:
            return
        extra = zlib.crc32(req.lora.name.encode()) if req.lora is not None else 0
        req.block_hashes = block_hashes_of(
            req.token_ids[:num_tokens], bs, self._root_hash, extra, req.block_hashes
        )

    def _cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        if not self.cfg.enable_prefix_caching:
            return
        num_tokens = min(num_tokens, len(req.token_ids))
        self._extend_hashes(req, num_tokens)
        self.kv.cache_full_blocks(req.seq, req.block_hashes, req.token_ids, num_tokens)

    def _complete(self, plan: list[_Scheduled], now: float) -> None:
        finished = False
        for item in plan:
            req = item.req
            if req.aborted or req.finished:
                continue
            req.num_computed += item.num_new
            if req.num_computed < len(req.token_ids):
                continue
            self._emit_token(req, now)
            if req.finished:
                finished = True
            elif req.wants_stream:
                req._notify()
        if finished:
            kept = []
            for req in self.running:
                if req.finished:
                    if req.do_remote_decode and req.finish_reason == "length":
                        req.kv_transfer_params = self._transfer_params(req)
                    self.kv.free(req.seq)
                else:
                    kept.append(req)
            self.running = kept
        if self.lora is not None and plan:
            self._record_lora()
        self._publish()

    def _emit_token(self, req: SimRequest, now: float) -> None:
        stats = self.stats
        n_out = len(req.output_ids)
        if n_out == 0:
            req.first_token_at = now
            stats.ttft.observe(now - req.arrival)
            stats.prompt_tokens += req.prompt_len
        else:
            stats.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        stats.generation_tokens += 1
        n_out += 1
        if n_out >= req.planned_tokens and n_out < req.max_tokens and n_out >= req.min_tokens:
            token = self.tokenizer.eos_token_id
            req.output_ids.append(token)
            req.token_ids.append(token)
            self._release_held(req)
            self._finish(req, "stop", now)
            return
        if self.cfg.output.mode == "echo":
            token = req.token_ids[(n_out - 1) % req.prompt_len]
        else:
            token = self._pool[(req.output_offset + n_out) % _POOL_SIZE]
        req.output_ids.append(token)
        req.token_ids.append(token)
        piece = req.decoder.push(token)
        done = n_out >= req.max_tokens
        if req.stop:
            if self._release_checking_stop(req, piece, n_out >= req.min_tokens):
                self._finish(req, "stop", now)
                return
        elif piece:
            req.released.append(piece)
        if done:
            self._release_held(req)
            self._finish(req, "length", now)

    @staticmethod
    def _release_held(req: SimRequest) -> None:
        if req.held:
            req.released.append(req.held)
            req.held = ""

    def _release_checking_stop(self, req: SimRequest, piece: str, may_stop: bool) -> bool:
        window = req.held + piece
        if may_stop:
            best = -1
            which = ""
            for s in req.stop:
                k = window.find(s)
                if k >= 0 and (best < 0 or k < best):
                    best, which = k, s
            if best >= 0:
                end = best + len(which) if req.include_stop else best
                if end > 0:
                    req.released.append(window[:end])
                req.held = ""
                req.stop_reason = which
                return True
        keep = max(len(s) for s in req.stop) - 1
        cut = len(window) - keep
        if cut > 0:
            req.released.append(window[:cut])
            req.held = window[cut:]
        else:
            req.held = window
        return False

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.finished_at = now
        stats = self.stats
        stats.finished[reason] = stats.finished.get(reason, 0) + 1
        stats.e2e.observe(now - req.arrival)
        if req.first_scheduled:
            stats.queue_time.observe(req.first_scheduled - req.arrival)
            stats.inference_time.observe(now - req.first_scheduled)
            if req.first_token_at:
                stats.prefill_time.observe(req.first_token_at - req.first_scheduled)
                stats.decode_time.observe(now - req.first_token_at)
        else:
            stats.queue_time.observe(now - req.arrival)
        stats.request_prompt_tokens.observe(req.prompt_len)
        stats.request_generation_tokens.observe(len(req.output_ids))
        req._notify()

    def _transfer_params(self, req: SimRequest) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": req.seq.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.advertised_host,
            "remote_port": self.advertised_port,
            "tp_size": 1,
        }

    def _record_lora(self) -> None:
        running = ",".join(dict.fromkeys(r.lora.name for r in self.running if r.lora is not None))
        waiting = ",".join(dict.fromkeys(r.lora.name for r in self.waiting if r.lora is not None))
        self.stats.record_lora(running, waiting, time.time())

    def _publish(self) -> None:
        if not self.kv.events:
            return
        events = self.kv.drain_events()
        if self.events is not None:
            self.events.publish(events, time.time())

    def _fail_all(self, reason: str) -> None:
        now = self._clock()
        for req in [*self.running, *self.waiting]:
            if not req.finished:
                self.kv.free(req.seq)
                self._finish(req, reason, now)
        self.running = []
        self.waiting.clear()

    # -- admin -------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset()
        self._publish()
        return ok
