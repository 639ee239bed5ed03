"""Print the gateway's /metrics text after a fixed set of requests, to diff two checkouts.

    PYTHONPATH=/other/src .venv/bin/python bench/metrics_render.py > /tmp/a.txt
    .venv/bin/python bench/metrics_render.py > /tmp/b.txt && diff /tmp/a.txt /tmp/b.txt

Fifty requests through `GatewayMetrics` (start, decision, attempt, finish, response
counter, P/D decisions, model rewrites, errors; streamed and not, several statuses,
fairness ids and priorities), then the scrape, with `_created` timestamps masked (they
differ run to run). A change to how the series are kept must leave this text as it was.
"""

from __future__ import annotations

import re
import sys

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.metrics import GatewayMetrics


def main() -> None:
    metrics = GatewayMetrics(lambda: [])
    for i in range(50):
        series = metrics.start("m", "t" if i % 3 else "m", "" if i % 2 else "tenant-a", i % 3)
        metrics.decision.observe(0.00004 * (i + 1))
        metrics.scheduled("t", f"10.0.0.{i % 2}:8000" if i % 7 else None)
        status = (200, 200, 503, 499, 429)[i % 5]
        record = AccessRecord("r", "POST", "/v1/chat/completions", status=status)
        record.ttft_ms, record.prompt_tokens, record.completion_tokens = 3.5 * i, 100 + i, i % 20
        record.cached_tokens, record.response_bytes, record.stream = 64, 900 + i, bool(i % 2)
        for at in (1.0, 1.0 + 0.001 * i, 1.1 + 0.002 * i):
            record.relayed(at)
        metrics.finish(series, record, 0.01 * i, 2000 + i, "Saturated" if i % 11 == 0 else None)
        metrics.response(record.status).inc()
        metrics.pd_decision("m", "prefill-decode" if i % 2 else "decode-only")
        if i % 4 == 0:
            metrics.rewritten("rule", "m", "t")
    metrics.error("BadRequest", model="x", fairness_id="", priority=0)
    text = metrics.render().decode()
    sys.stdout.write(re.sub(r"(_created\{[^}]*\}|_created) \S+", r"\1 <t>", text))


if __name__ == "__main__":
    main()
