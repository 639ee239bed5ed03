"""Structured logs: one JSON line per proxied request, and JSON for everything else.

The access line is rendered with orjson (no logging formatter machinery on the hot
path) into a buffer that goes to the stream in one write every `FLUSH_INTERVAL_S`, or
sooner when the next line would take it past `FLUSH_BYTES` (the pipe's atomic write
size, so that workers sharing a stdout pipe never interleave parts of lines), so a
busy gateway pays one write(2) for several lines rather than one per loop turn; the
buffer is written out at shutdown (the servers call `flush`, and an exit hook covers
every other clean exit). Probes and /metrics are never logged.

The record is a plain (not slotted) dataclass: orjson renders an instance from its
`__dict__` about three times faster than from slots, which is more than the slots save
when the record is built.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import select
import sys
import time
import weakref
from bisect import bisect_left
from dataclasses import MISSING, dataclass, field, fields
from typing import IO, Any

import orjson

from servegate.gateway.histogram import TPOT_BUCKETS, Buckets

LOG_FIELD_CHARS = 256
"""Client-supplied strings (model names, error echoes) are cut to this in the access log."""
CLIPPED_FIELDS = ("model", "target_model", "error", "prefill_error", "path")
FLUSH_INTERVAL_S = 0.05
"""The longest a line waits in the buffer while the event loop runs."""
FLUSH_BYTES: int = getattr(select, "PIPE_BUF", 512)
"""The most one write holds (unless one line is longer): a pipe takes this much atomically."""


class _Relayed:
    """A record's inter-chunk bookkeeping. Not dataclass fields (a base that is not a
    dataclass contributes none): class-level defaults until a stream's chunks set them on
    the instance, so that a unary request's record never stores them. orjson skips `_`
    names."""

    _relayed_at: float = 0.0
    _itl: Buckets | None = None
    """Gaps between response chunks relayed, bucketed as the ITL histogram counts them."""

    def relayed(self, now: float) -> None:
        """A response chunk went to the client at `now` (monotonic): count the gap since
        the previous one (`llm_d_epp_request_streaming_itl_seconds`)."""
        last = self._relayed_at
        self._relayed_at = now
        if last:
            gaps = self._itl
            if gaps is None:
                gaps = self._itl = Buckets(TPOT_BUCKETS)
            gap = now - last
            gaps.counts[bisect_left(TPOT_BUCKETS, gap)] += 1
            gaps.sum += gap

    @property
    def itl(self) -> Buckets | None:
        """The inter-chunk gaps of the relayed response; None before a second chunk."""
        return self._itl


@dataclass
class AccessRecord(_Relayed):
    """One access-log line; its public fields, in this order, are the line's keys."""

    request_id: str
    method: str
    path: str
    ts: float = field(default_factory=time.time)
    logger: str = "servegate.access"
    model: str | None = None
    target_model: str | None = None
    """The model the replica was asked for: `model` after aliases and traffic splits."""
    pool: str | None = None
    tenant: str | None = None
    """The tenant whose key the request carried (never the key)."""
    endpoint: str | None = None
    status: int = 0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    response_bytes: int = 0
    """Bytes of response body relayed to the client."""
    retries: int = 0
    stream: bool = False
    error: str | None = None
    pd_decision: str | None = None
    """Prefill/decode: `prefill-decode` or `decode-only`; None without a P/D profile handler."""
    prefill_endpoint: str | None = None
    prefill_status: int | None = None
    """Gateway-orchestrated prefill leg: its HTTP status (None: no answer, or sidecar mode)."""
    prefill_ms: float | None = None
    prefill_error: str | None = None
    """Why the prefill leg failed and the decode replica prefilled by itself."""
    predicted_ttft_ms: float | None = None
    """The latency predictor's TTFT for the chosen endpoint, from arrival (like `ttft_ms`)."""
    predicted_tpot_ms: float | None = None
    tpot_ms: float | None = None
    """Measured time per output token after the first (streams that report usage)."""
    dispatched_ms: float | None = None
    """Time from arrival to the scheduling decision (queueing, tokenisation)."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    @classmethod
    def arrived(cls, request_id: str, method: str, path: str) -> AccessRecord:
        """A request's record at arrival, every other field at its default: the same as
        `AccessRecord(request_id, method, path)` at about half the cost (one copy of the
        defaults instead of 31 attribute stores)."""
        record = object.__new__(cls)
        values = record.__dict__
        values.update(_ARRIVAL)
        values["request_id"] = request_id
        values["method"] = method
        values["path"] = path
        values["ts"] = time.time()
        return record


_ARRIVAL = {
    f.name: None if f.default is MISSING else f.default
    for f in fields(AccessRecord)  # in field order, which is the line's key order
}


def _clip(record: AccessRecord) -> bool:
    """Cut the client-supplied strings longer than `LOG_FIELD_CHARS`; True if any was."""
    limit = LOG_FIELD_CHARS
    if (
        len(record.path) <= limit
        and len(record.model or "") <= limit
        and len(record.target_model or "") <= limit
        and len(record.error or "") <= limit
        and len(record.prefill_error or "") <= limit
    ):
        return False
    clipped = False
    for name in CLIPPED_FIELDS:
        value = getattr(record, name)
        if value is not None and len(value) > LOG_FIELD_CHARS:
            setattr(record, name, f"{value[:LOG_FIELD_CHARS]}… ({len(value)} characters)")
            clipped = True
    return clipped


def _clip_check_bytes() -> int:
    """The shortest line in which a field can hold more than `LOG_FIELD_CHARS` characters.

    A line is at least its keys and punctuation plus one byte per value; a string of
    more than `LOG_FIELD_CHARS` characters takes that many bytes more (and its quotes),
    so a shorter line needs no look at its fields."""
    names = [f.name for f in fields(AccessRecord) if not f.name.startswith("_")]
    keys = sum(len(orjson.dumps(name)) + len(":") + 1 for name in names)
    punctuation = len("{}") + len(names) - 1 + len("\n")
    return keys + punctuation + LOG_FIELD_CHARS + 1


CLIP_CHECK_BYTES = _clip_check_bytes()

_open_logs: weakref.WeakSet[AccessLog] = weakref.WeakSet()


@atexit.register
def _flush_open_logs() -> None:
    """A process that exits cleanly writes out what its logs still buffer."""
    for log in list(_open_logs):
        log.flush()


class AccessLog:
    """Buffers the access lines and writes them together (see the module docstring)."""

    def __init__(
        self,
        stream: IO[bytes] | None = None,
        enabled: bool = True,
        interval_s: float = FLUSH_INTERVAL_S,
        max_bytes: int = FLUSH_BYTES,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self.enabled = enabled
        self._interval_s = interval_s
        self._max_bytes = max_bytes
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        _open_logs.add(self)

    def write(self, record: AccessRecord) -> None:
        if not self.enabled:
            return
        line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        if len(line) >= CLIP_CHECK_BYTES and _clip(record):
            line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        buffer = self._buffer
        if len(buffer) + len(line) > self._max_bytes:
            self._write_out()  # never a line split across two writes
            buffer = self._buffer
        buffer += line  # a copy: orjson's output, kept alive, costs more than copying it
        armed = self._timer_loop
        if self._timer is not None and armed is not None and armed.is_running():
            return  # the flush is due on the loop running now (one loop per thread)
        try:
            loop = asyncio.get_running_loop()  # a getpid system call on 3.11: not per line
        except RuntimeError:
            self.flush()
            return
        if self._timer is None or self._timer_loop is not loop:
            # a timer on a loop that has since closed never fires: arm one on this loop
            self._timer_loop = loop
            self._timer = loop.call_later(self._interval_s, self.flush)

    def flush(self) -> None:
        """Write every buffered line in one write, and flush the stream."""
        timer = self._timer
        if timer is not None:
            self._timer = self._timer_loop = None
            timer.cancel()
        self._write_out()

    def _write_out(self) -> None:
        data = self._buffer
        if not data:
            return
        self._buffer = bytearray()
        try:
            self._stream.write(data)
            self._stream.flush()
        except (OSError, ValueError):
            pass


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").disabled = True
