"""Structured logs: one JSON line per proxied request, and JSON for everything else.

The access line is written with orjson straight to the stream (no logging
formatter machinery on the hot path) and flushed once per event-loop turn, so the
requests that finish together share one write; probes and /metrics are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from servegate.gateway.histogram import TPOT_BUCKETS, Buckets

LOG_FIELD_CHARS = 256
"""Client-supplied strings (model names, error echoes) are cut to this in the access log."""
CLIPPED_FIELDS = ("model", "target_model", "error", "prefill_error", "path")


@dataclass(slots=True)
class AccessRecord:
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
    _relayed_at: float = 0.0
    _itl: Buckets | None = None
    """Gaps between response chunks relayed, bucketed as the ITL histogram counts them
    (not logged: orjson skips `_` fields)."""

    def relayed(self, now: float) -> None:
        """A response chunk went to the client at `now` (monotonic): count the gap since
        the previous one (`llm_d_epp_request_streaming_itl_seconds`)."""
        last = self._relayed_at
        self._relayed_at = now
        if last:
            gaps = self._itl
            if gaps is None:
                gaps = self._itl = Buckets(TPOT_BUCKETS)
            gaps.observe(now - last)

    @property
    def itl(self) -> Buckets | None:
        """The inter-chunk gaps of the relayed response; None before a second chunk."""
        return self._itl


class AccessLog:
    def __init__(self, stream: IO[bytes] | None = None, enabled: bool = True) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self.enabled = enabled
        self._flush_due = False

    def write(self, record: AccessRecord) -> None:
        if not self.enabled:
            return
        for name in CLIPPED_FIELDS:
            value = getattr(record, name)
            if value is not None and len(value) > LOG_FIELD_CHARS:
                setattr(record, name, f"{value[:LOG_FIELD_CHARS]}… ({len(value)} characters)")
        try:
            self._stream.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        except (OSError, ValueError):
            return
        if self._flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_due = False
        try:
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
