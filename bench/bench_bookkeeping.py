"""Time a request's bookkeeping alone: its context, lease, metrics and access-log line.

    .venv/bin/python bench/bench_bookkeeping.py [--requests N] [--per-turn K] [--log PATH]

Each request goes through the steps the `Director` runs around routing and relaying,
without the routing and the relaying themselves: `begin` (context and access record),
`GatewayMetrics.start`, a `Lease`, flow control's admission of a request that need not
wait (as the checkout's `Director.route` calls it: `admit_now` where there is one, else
the awaited `admit`) and the response headers it sets, the lease bound to an endpoint,
the decision and attempt observations, the record's response fields, `complete`, and
`finish` (the lease's release, `GatewayMetrics.finish`, the response counter and the
access-log line). `K`
requests end per event-loop turn (the gateway at saturation ends one to a few per turn),
so a per-turn flush is counted as the gateway pays it. The access log goes to a real
file (`--log`, a temporary one by default), as the gateway's stdout does in
`bench/gateway_overhead.py`.

It prints CPU microseconds per request (`time.process_time`, so that another process's
turn on a shared core is not counted) for the whole loop, for the loop's own cost (the
request id, the response fields and the loop turns, without the bookkeeping), their
difference (the bookkeeping), and the access log's share (the same run with the log
disabled), each the minimum of `--repeats` runs of N requests (noise only ever adds).
Run it against another checkout with `PYTHONPATH=/other/src` to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from servegate.config import parse_config
from servegate.control.lease import Lease
from servegate.gateway.admission import QUEUE_DURATION_HEADER, queue_ms
from servegate.gateway.app import Gateway, build_gateway
from servegate.gateway.server import event_loop_factory
from servegate.pool.endpoint import EndpointMetrics
from servegate.scheduling.request import LLMRequest, RequestKind

ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000")
HEADERS = {"content-type": "application/json", "host": "gateway"}


def gateway(stream: IO[bytes], log: bool) -> Gateway:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 1, "access_log": log},
        "pool": {"endpoints": [{"url": f"http://{a}", "model": "m"} for a in ADDRESSES]},
    }
    gw = build_gateway(parse_config("", "<bench>", environ={}, overrides=cfg), None, stream)
    now = time.monotonic()
    for address in ADDRESSES:
        gw.pool.set_health(address, True)
        gw.pool.set_metrics(address, EndpointMetrics(scraped_at=now))
    return gw


async def harness(requests: int, per_turn: int) -> float:
    """The loop's own cost: the request id, the response fields set, the loop turns."""
    gw = gateway(io.BytesIO(), False)
    record = gw.director.begin("r", "POST", "/v1/chat/completions", HEADERS, 0.0).record
    address = next(iter(gw.pool)).address
    gc.collect()
    t0 = time.process_time()
    for i in range(requests):
        record.request_id = f"req-{i}"
        record.model = record.target_model = "m"
        record.pool = "default"
        record.endpoint = address
        record.status, record.ttft_ms, record.response_bytes = 200, 3.5, 640
        record.prompt_tokens, record.completion_tokens = 300, 16
        if i % per_turn == per_turn - 1:
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    return (time.process_time() - t0) / requests * 1e6


async def run(requests: int, per_turn: int, stream: IO[bytes], log: bool) -> float:
    gw = gateway(stream, log)
    director, metrics, runtime = gw.director, gw.metrics, gw.default
    states = list(gw.pool)
    admission = runtime.admission
    admit_now = getattr(admission, "admit_now", None)
    llm = LLMRequest("r", RequestKind.CHAT, "m", "m", "m", headers=HEADERS, prompt_tokens=300)
    gc.collect()
    t0 = time.process_time()
    for i in range(requests):
        ctx = director.begin(f"req-{i}", "POST", "/v1/chat/completions", HEADERS, time.monotonic())
        record = ctx.record
        record.model = record.target_model = "m"
        record.pool = runtime.name
        ctx.series = metrics.start("m", "m", "", 0)
        lease = ctx.lease = Lease(runtime)
        if admit_now is None:
            queued = await admission.admit(llm, 1500, None)
        elif not admit_now(llm, 1500, 0):
            raise RuntimeError("flow control held a request back")
        else:
            queued = 0.0
        lease.admit()
        extra = ctx.response_headers
        extra["X-Request-ID"] = ctx.request_id
        extra[QUEUE_DURATION_HEADER] = queue_ms(queued)
        state = states[i & 1]
        lease.bind(state, 1200, time.monotonic())
        metrics.decision.observe(0.00004)
        metrics.scheduled("m", state.address)
        record.endpoint = state.address
        record.status, record.ttft_ms, record.response_bytes = 200, 3.5, 640
        record.prompt_tokens, record.completion_tokens = 300, 16
        director.complete(ctx)
        director.finish(ctx)
        if i % per_turn == per_turn - 1:
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    elapsed = time.process_time() - t0
    gw.access_log.flush()
    return elapsed / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--per-turn", type=int, default=2)
    parser.add_argument("--log", type=Path, default=None, help="access-log file (a temp one)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.log or Path(tmp) / "access.log"
        results: dict[str, list[float]] = {"with log": [], "log off": [], "harness": []}
        for _ in range(args.repeats):
            for name, log in (("with log", True), ("log off", False)):
                with path.open("wb") as handle:
                    stream: IO[bytes] = handle if log else io.BytesIO()
                    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                        us = runner.run(run(args.requests, args.per_turn, stream, log))
                    results[name].append(us)
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                results["harness"].append(runner.run(harness(args.requests, args.per_turn)))
        with_log, without, floor = (min(v) for v in results.values())
        print(f"loop, access log on        : {with_log:6.2f} µs per request")
        print(f"loop, access log off       : {without:6.2f} µs per request")
        print(f"loop's own cost (harness)  : {floor:6.2f} µs per request")
        print(f"bookkeeping (on - harness) : {with_log - floor:6.2f} µs per request")
        print(f"access log's share (on-off): {with_log - without:6.2f} µs per request")


if __name__ == "__main__":
    main()
