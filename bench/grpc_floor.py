"""The Python gRPC floor of an ext_proc picker: CPU per request of a no-op servicer.

A servicer with no picker behind it answers every ext_proc message with a canned
answer; this process plays Envoy. What changes between rows is only what the protocol
costs: the server flavour and how many messages Envoy's processing mode exchanges.

  server  aio   grpc.aio server on uvloop, async-generator servicer (servegate's today)
          sync  grpc.server on a thread pool (16 threads), generator servicer
  exchange
          4x4   FULL_DUPLEX_STREAMED as servegate's picker runs it: request headers,
                request body (one chunk, end of stream), response headers, response body
                — four messages each way (bench_extproc.py's "protocol floor")
          2x2   request headers + BUFFERED request body; response headers and body SKIP/NONE
          1x1   request headers SKIP, BUFFERED request body only: the destination and
                headers set from the body answer's header mutation

Per row: the servicer process's utime + stime over `--requests` requests at
`--concurrency` streams in flight (process pinned to `--server-core`), divided by the
requests; and p50 of one stream's wall time.

    .venv/bin/python bench/grpc_floor.py --requests 3000 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    ExternalProcessorStub,
    add_ExternalProcessorServicer_to_server,
)

from servegate.extproc import client as envoy
from servegate.extproc import protocol

DESTINATION = "10.0.0.1:8000"
EXCHANGES = ("4x4", "2x2", "1x1")
HEADERS = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gateway"),
    ("content-type", "application/json"),
    ("x-request-id", "bench"),
    ("user-agent", "bench"),
]
RESPONSE = orjson.dumps({"object": "chat.completion", "choices": [], "usage": {}})


def answers() -> dict[str, Any]:
    """Canned answers, built once."""
    headers = protocol.request_headers_response(
        {protocol.DESTINATION_KEY: DESTINATION}, (), DESTINATION
    )
    body = protocol.request_body_responses(b"", True)
    return {
        "headers": headers,
        "body": body,
        "response_headers": protocol.response_headers_response({}),
        "response_body": protocol.response_body_response(RESPONSE, True),
    }


class AioFloor(ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.canned = answers()

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        canned = self.canned
        echo = False
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                echo = request.protocol_config.request_body_mode == protocol.FULL_DUPLEX
                yield canned["headers"]
            elif kind == "request_body":
                if echo:  # FULL_DUPLEX_STREAMED: the body goes back to Envoy
                    for answer in protocol.request_body_responses(request.request_body.body, True):
                        yield answer
                else:
                    for answer in canned["body"]:
                        yield answer
            elif kind == "response_headers":
                yield canned["response_headers"]
            elif kind == "response_body":
                yield canned["response_body"]


class SyncFloor(ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.canned = answers()

    def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        canned = self.canned
        echo = False
        for request in requests:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                echo = request.protocol_config.request_body_mode == protocol.FULL_DUPLEX
                yield canned["headers"]
            elif kind == "request_body":
                if echo:  # FULL_DUPLEX_STREAMED: the body goes back to Envoy
                    yield from protocol.request_body_responses(request.request_body.body, True)
                else:
                    yield from canned["body"]
            elif kind == "response_headers":
                yield canned["response_headers"]
            elif kind == "response_body":
                yield canned["response_body"]


async def serve_aio() -> None:
    server = grpc.aio.server()
    add_ExternalProcessorServicer_to_server(AioFloor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY {port}", flush=True)
    await server.wait_for_termination()


def serve_sync() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add_ExternalProcessorServicer_to_server(SyncFloor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY {port}", flush=True)
    server.wait_for_termination()


def messages(exchange: str, body: bytes) -> list[tuple[Any, int]]:
    """(message to send, answers to read after it) for one request."""
    headers = envoy.request_headers(HEADERS)
    request_body = envoy.request_body(body, True)
    if exchange == "1x1":
        return [(request_body, 1)]
    if exchange == "2x2":
        buffered = envoy.request_headers(HEADERS, body_mode=ProcessingMode.BUFFERED)
        return [(buffered, 1), (request_body, 1)]
    served = envoy.response_headers([(":status", "200")], served=DESTINATION)
    # the canned request-body answers are one message for a one-chunk body
    return [(headers, 1), (request_body, 1), (served, 1), (envoy.response_body(RESPONSE, True), 1)]


async def one(stub: Any, plan: list[tuple[Any, int]]) -> float:
    t0 = time.perf_counter()
    call = stub.Process()
    for message, expected in plan:
        await call.write(message)
        for _ in range(expected):
            await call.read()
    await call.done_writing()
    while (await call.read()) is not grpc.aio.EOF:
        pass
    return (time.perf_counter() - t0) * 1e6


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    port: int, pid: int, plan: list[tuple[Any, int]], requests: int, concurrency: int
) -> tuple[float, list[float], float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ExternalProcessorStub(channel)
        for _ in range(50):
            await one(stub, plan)
        remaining = [requests]
        walls: list[float] = []

        async def worker() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                walls.append(await one(stub, plan))

        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        return (cpu_s(pid) - cpu0) / requests * 1e6, walls, requests / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--serve", choices=["aio", "sync"], help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--servers", default="aio,sync")
    parser.add_argument("--exchanges", default=",".join(EXCHANGES))
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--server-core", type=int, default=0)
    args = parser.parse_args()
    if args.serve == "aio":
        import uvloop

        uvloop.run(serve_aio())
        return
    if args.serve == "sync":
        serve_sync()
        return
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x" * args.prompt_chars}],
            "max_tokens": 16,
        }
    )
    print(f"{args.requests} requests per row, load average {os.getloadavg()[0]:.1f}")
    print("| server | exchange | streams in flight | servicer CPU µs/request | p50 µs | req/s |")
    print("|---|---|---|---|---|---|")
    for server in args.servers.split(","):
        proc = subprocess.Popen(
            ["taskset", "-c", str(args.server_core), sys.executable, __file__, "--serve", server],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                raise RuntimeError(f"servicer did not start: {line!r}")
            port = int(line.split()[1])
            for exchange in args.exchanges.split(","):
                plan = messages(exchange, body)
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    import uvloop

                    cpu_us, walls, rate = uvloop.run(
                        drive(port, proc.pid, plan, args.requests, concurrency)
                    )
                    print(
                        f"| {server} | {exchange} | {concurrency} | {cpu_us:.0f} "
                        f"| {statistics.median(walls):.0f} | {rate:.0f} |",
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
