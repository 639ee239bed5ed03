"""Endpoint-picker latency over gRPC ext_proc, per request (not a test).

A picker process (`--serve`, uvloop) holds a pool of N endpoints with seeded
random metrics (no replicas: no scraping, no health probes) and the given
profile. This process plays Envoy: per request it opens a `Process` stream and
sends exactly what Envoy sends in FULL_DUPLEX_STREAMED mode — request headers,
the body in 16 KiB chunks (last with `end_of_stream`), then the response
headers with the served endpoint, one response body chunk, end of stream.

The first row is the protocol floor: the same gRPC exchange answered with canned
messages by a servicer with no picker behind it.

Reported per request:
  decision   request headers sent → last request-body answer received (what Envoy waits for
             before it can connect upstream; includes gRPC, parsing, flow control, scheduling)
  stream     the whole stream, request and response path
and requests/s with C streams in flight, and the picker process's CPU per request.

    .venv/bin/python bench/bench_extproc.py [--requests 3000] [--endpoints 10,100]
        [--concurrency 1,16] [--prompt-chars 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
import orjson

from servegate.config import parse_config
from servegate.extproc.client import ProxyStream
from servegate.gateway.app import build_gateway
from servegate.gateway.server import event_loop_factory
from servegate.pool.endpoint import EndpointMetrics

MODEL = "bench-model"
PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "active-request-scorer"},
        {"type": "prefix-cache-scorer"},
        {"type": "max-score-picker"},
    ],
}
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


def picker_config(endpoints: int, port: int) -> dict[str, Any]:
    return {
        "gateway": {"seed": 1, "access_log": False},
        "extproc": {"host": "127.0.0.1", "port": port},
        "pool": {
            "metrics_staleness_s": 86_400,
            "endpoints": [
                {"url": f"http://10.{i // 250}.{i % 250}.1:8000", "model": MODEL}
                for i in range(endpoints)
            ],
        },
        "picker": PICKER,
    }


# -- the picker process ----------------------------------------------------------------


async def serve(endpoints: int, port: int) -> None:
    from servegate.extproc.server import PickerServicer, add_ExternalProcessorServicer_to_server

    config = parse_config("", "<bench>", environ={}, overrides=picker_config(endpoints, port))
    gw = build_gateway(config, None, io.BytesIO())
    rng = random.Random(0)
    now = time.monotonic()
    for state in gw.pool:
        gw.pool.set_health(state.address, True)
        metrics = EndpointMetrics(
            waiting=float(rng.randint(0, 8)), kv_usage=rng.random(), scraped_at=now
        )
        gw.pool.set_metrics(state.address, metrics)
    server = grpc.aio.server()
    add_ExternalProcessorServicer_to_server(PickerServicer(gw), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"READY {bound}", flush=True)
    await server.wait_for_termination()


async def serve_floor() -> None:
    """The same protocol with no picker behind it: canned answers, the body echoed back."""
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
        ExternalProcessorServicer,
        add_ExternalProcessorServicer_to_server,
    )

    from servegate.extproc import protocol

    headers_answer = protocol.request_headers_response(
        {protocol.DESTINATION_KEY: "10.0.0.1:8000"}, (), "10.0.0.1:8000"
    )
    response_headers_answer = protocol.response_headers_response({})

    class Floor(ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, requests: Any, context: Any) -> Any:
            body = b""
            async for request in requests:
                kind = request.WhichOneof("request")
                if kind == "request_body":
                    body += request.request_body.body
                    if request.request_body.end_of_stream:
                        yield headers_answer
                        for answer in protocol.request_body_responses(body, True):
                            yield answer
                elif kind == "response_headers":
                    yield response_headers_answer
                elif kind == "response_body":
                    chunk = request.response_body
                    yield protocol.response_body_response(chunk.body, chunk.end_of_stream)

    server = grpc.aio.server()
    add_ExternalProcessorServicer_to_server(Floor(), server)
    bound = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY {bound}", flush=True)
    await server.wait_for_termination()


# -- the proxy side ---------------------------------------------------------------------


@dataclass
class Run:
    decision_us: list[float]
    stream_us: list[float]
    wall_s: float
    picker_cpu_s: float


def body_for(i: int, prompt_chars: int, rng: random.Random) -> bytes:
    prefix = WORDS[i % len(WORDS)] * (prompt_chars // 2 // len(WORDS[i % len(WORDS)]))
    tail = "".join(rng.choice("abcdefghij ") for _ in range(prompt_chars - len(prefix)))
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": prefix + tail}], "max_tokens": 64}
    )


RESPONSE = orjson.dumps(
    {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 500,
                                                           "completion_tokens": 64}}
)  # fmt: skip


async def one(channel: grpc.aio.Channel, body: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    stream = ProxyStream(channel)
    answer = await stream.request("/v1/chat/completions", body, headers=[("x-request-id", "b")])
    t1 = time.perf_counter()
    if answer.destination is None:
        raise RuntimeError(f"picker did not route: {answer}")
    await stream.respond(200, [RESPONSE], served=answer.endpoints[0])
    await stream.close()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6, (t2 - t0) * 1e6


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, pid: int, bodies: list[bytes], concurrency: int) -> Run:
    decisions: list[float] = []
    streams: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        for body in bodies[:50]:
            await one(channel, body)
        queue = list(reversed(bodies))
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                decision, whole = await one(channel, queue.pop())
                decisions.append(decision)
                streams.append(whole)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = cpu_s(pid) - cpu0
    return Run(decisions, streams, wall, cpu)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_picker(endpoints: int) -> tuple[subprocess.Popen[str], int]:
    """`endpoints` 0: the protocol floor (no picker)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--endpoints", str(endpoints)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"picker did not start: {line!r}")
    return proc, int(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--endpoints", default="10,100")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompt-chars", type=int, default=2000)
    args = parser.parse_args()
    if args.serve:
        endpoints = int(args.endpoints)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve(endpoints, 0) if endpoints else serve_floor())
        return
    rng = random.Random(42)
    bodies = [body_for(i, args.prompt_chars, rng) for i in range(args.requests)]
    print(f"python {platform.python_version()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"{args.requests} requests, {args.prompt_chars}-char prompts, picker: 4 scorers")  # fmt: skip
    print("| endpoints | streams in flight | decision p50 | decision p99 | stream p50 | "
          "stream p99 | requests/s | picker CPU/request |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for endpoints in [0, *(int(e) for e in args.endpoints.split(","))]:
        proc, port = start_picker(endpoints)
        try:
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                    run = runner.run(drive(port, proc.pid, bodies, concurrency))
                n = len(run.decision_us)
                label = endpoints or "protocol floor (no picker)"
                print(
                    f"| {label} | {concurrency} | {statistics.median(run.decision_us):.0f} µs "
                    f"| {pct(run.decision_us, 0.99):.0f} µs "
                    f"| {statistics.median(run.stream_us):.0f} µs "
                    f"| {pct(run.stream_us, 0.99):.0f} µs | {n / run.wall_s:.0f} "
                    f"| {run.picker_cpu_s / n * 1e6:.0f} µs |",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
