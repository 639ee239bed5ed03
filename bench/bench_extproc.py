"""Endpoint-picker CPU and latency over gRPC ext_proc, per request, side by side (not a test).

Each target is a picker process (`--serve`, uvloop, pinned with `taskset` to
`--picker-core`) holding a pool of N endpoints with seeded random metrics (no replicas:
no scraping, no health probes) and a four-scorer profile. This process plays Envoy,
per request on its own `Process` stream, in one of two processing modes:

  full-duplex  FULL_DUPLEX_STREAMED both ways (deploy/extproc/envoy.yaml):
               request headers, the body in 16 KiB chunks (last with `end_of_stream`),
               response headers with the served endpoint, every response body chunk
  buffered     deploy/extproc/envoy-buffered.yaml: request headers (answered at once), the whole
               body in one message, response headers; response body NONE

and one of two answers from the model server: `json` (one body chunk) or `sse32` (a
32-event stream, one chunk per event, the last carrying usage).

Targets: `servegate` (this checkout's `src/`) and any `--compare NAME=SRC_DIR` (another
checkout's `src/`, e.g. main's), plus `floor`: the same exchange answered with canned
messages by a servicer with no picker behind it. A target that refuses a mode (main
before BUFFERED support) is reported as such. For each answer and concurrency every
(mode, target) pair takes a turn, `--rounds` times with the order rotating, so the
ratios compare runs from the same minutes; a cell is the median over the rounds.

Reported per request: *decision* (request headers sent → the routing answer received:
what Envoy waits for before it connects upstream), the picker process's CPU (utime +
stime from /proc) per request, requests/s; and the ratio of CPU per request to the
first `--compare` target's full-duplex figure for the same answer and concurrency.

    .venv/bin/python bench/bench_extproc.py [--requests 1000] [--endpoints 10]
        [--concurrency 1,16] [--modes full-duplex,buffered] [--answers json,sse32]
        [--compare main=/work/main/src] [--rounds 3] [--picker-core 0]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
import orjson

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
MODES = ("full-duplex", "buffered")
ANSWERS = ("json", "sse32")
FLOOR = "floor"


def picker_config(endpoints: int) -> dict[str, Any]:
    return {
        "gateway": {"seed": 1, "access_log": False},
        "extproc": {"host": "127.0.0.1", "port": 0},
        "pool": {
            "metrics_staleness_s": 86_400,
            "endpoints": [
                {"url": f"http://10.{i // 250}.{i % 250}.1:8000", "model": MODEL}
                for i in range(endpoints)
            ],
        },
        "picker": PICKER,
    }


# -- the picker process (runs with the target's `src/` first on sys.path) ---------------


async def serve(endpoints: int) -> None:
    from servegate.config import parse_config
    from servegate.extproc import server as extproc_server
    from servegate.gateway.app import build_gateway
    from servegate.pool.endpoint import EndpointMetrics

    config = parse_config("", "<bench>", environ={}, overrides=picker_config(endpoints))
    gw = build_gateway(config, None, io.BytesIO())
    rng = random.Random(0)
    now = time.monotonic()
    for state in gw.pool:
        gw.pool.set_health(state.address, True)
        metrics = EndpointMetrics(
            waiting=float(rng.randint(0, 8)), kv_usage=rng.random(), scraped_at=now
        )
        gw.pool.set_metrics(state.address, metrics)
    server = grpc.aio.server(options=extproc_server.GRPC_OPTIONS)
    extproc_server.add_ExternalProcessorServicer_to_server(
        extproc_server.PickerServicer(gw), server
    )
    bound = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY {bound}", flush=True)
    await server.wait_for_termination()


async def serve_floor() -> None:
    """Both modes with no picker behind them: canned answers, the bodies echoed back."""
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
        ExternalProcessorServicer,
        add_ExternalProcessorServicer_to_server,
    )

    from servegate.extproc import protocol
    from servegate.extproc.server import GRPC_OPTIONS

    destination = "10.0.0.1:8000"
    headers_answer = protocol.request_headers_response(
        {protocol.DESTINATION_KEY: destination}, (), destination
    )
    buffered_answer = protocol.buffered_body_response(
        {protocol.DESTINATION_KEY: destination}, (), destination, None
    )
    response_headers_answer = protocol.response_headers_response({})

    async def process(self: Any, requests: Any, context: Any) -> Any:
        buffered = False
        body = b""
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                buffered = request.protocol_config.request_body_mode == protocol.BUFFERED
                if buffered:
                    yield protocol.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body" and buffered:
                yield buffered_answer
            elif kind == "request_body":
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

    floor = type("Floor", (ExternalProcessorServicer,), {"Process": process})
    server = grpc.aio.server(options=GRPC_OPTIONS)
    add_ExternalProcessorServicer_to_server(floor(), server)
    bound = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY {bound}", flush=True)
    await server.wait_for_termination()


# -- the proxy side ---------------------------------------------------------------------


@dataclass
class Run:
    decision_us: list[float]
    wall_s: float
    picker_cpu_s: float
    refused: str | None = None


def body_for(i: int, prompt_chars: int, rng: random.Random) -> bytes:
    prefix = WORDS[i % len(WORDS)] * (prompt_chars // 2 // len(WORDS[i % len(WORDS)]))
    tail = "".join(rng.choice("abcdefghij ") for _ in range(prompt_chars - len(prefix)))
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": prefix + tail}], "max_tokens": 64}
    )


def answer_chunks(answer: str) -> tuple[str, list[bytes]]:
    if answer == "json":
        usage = {"prompt_tokens": 500, "completion_tokens": 64}
        return "application/json", [
            orjson.dumps({"object": "chat.completion", "choices": [], "usage": usage})
        ]
    events = [
        b"data: " + orjson.dumps({"object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]})
        + b"\n\n"
        for i in range(31)
    ]  # fmt: skip
    usage = {"prompt_tokens": 500, "completion_tokens": 31}
    last = b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    return "text/event-stream", [*events, last]


async def one(
    channel: grpc.aio.Channel, modes: Any, body: bytes, answer: tuple[str, list[bytes]]
) -> float:
    from servegate.extproc.client import ProxyStream

    t0 = time.perf_counter()
    stream = ProxyStream(channel, modes)
    routed = await stream.request("/v1/chat/completions", body, headers=[("x-request-id", "b")])
    t1 = time.perf_counter()
    if routed.destination is None:
        raise RuntimeError(f"picker did not route: {routed}")
    content_type, chunks = answer
    await stream.respond(200, chunks, served=routed.endpoints[0], content_type=content_type)
    await stream.close()
    return (t1 - t0) * 1e6


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    port: int, pid: int, mode: str, answer: str, bodies: list[bytes], concurrency: int
) -> Run:
    from servegate.extproc.client import BUFFERED_NO_RESPONSE_BODY
    from servegate.extproc.protocol import FULL_DUPLEX_MODES

    modes = BUFFERED_NO_RESPONSE_BODY if mode == "buffered" else FULL_DUPLEX_MODES
    chunks = answer_chunks(answer)
    decisions: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            for body in bodies[:30]:
                await one(channel, modes, body, chunks)
        except grpc.aio.AioRpcError as exc:
            return Run([], 0.0, 0.0, refused=exc.code().name)
        queue = list(reversed(bodies))
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                decisions.append(await one(channel, modes, queue.pop(), chunks))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = cpu_s(pid) - cpu0
    return Run(decisions, wall, cpu)


def start_picker(src: str | None, endpoints: int, core: int | None) -> tuple[Any, int]:
    """`src`: the target's `src/` directory (None: the floor)."""
    env = dict(os.environ)
    command = [sys.executable, __file__, "--serve"]
    if src is None:
        command += ["--endpoints", "0"]
    else:
        command += ["--endpoints", str(endpoints)]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"picker did not start: {line!r}")
    return proc, int(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--answers", default=",".join(ANSWERS))
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compare", action="append", default=[], metavar="NAME=SRC_DIR",
        help="another checkout's src/ to run side by side (the first is the ratios' baseline)",
    )  # fmt: skip
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--picker-core", type=int, default=0, help="-1: do not pin")
    args = parser.parse_args()
    if args.serve:
        from servegate.gateway.server import event_loop_factory

        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve(args.endpoints) if args.endpoints else serve_floor())
        return
    from servegate.gateway.server import event_loop_factory

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    targets: dict[str, str | None] = {"servegate": here}
    for spec in args.compare:
        name, _, src = spec.partition("=")
        targets[name] = src
    if not args.no_floor:
        targets[FLOOR] = None
    baseline = args.compare[0].partition("=")[0] if args.compare else "servegate"
    core = None if args.picker_core < 0 or shutil.which("taskset") is None else args.picker_core
    rng = random.Random(42)
    bodies = [body_for(i, args.prompt_chars, rng) for i in range(args.requests)]
    load = os.getloadavg()
    print(f"python {platform.python_version()} {platform.machine()}, {os.cpu_count()} cpus, "
          f"load {load[0]:.1f}, {args.requests} requests x {args.rounds} rounds, "
          f"{args.prompt_chars}-char prompts, {args.endpoints} endpoints, 4 scorers, "
          f"picker core {core}", flush=True)  # fmt: skip
    procs = {name: start_picker(src, args.endpoints, core) for name, src in targets.items()}
    results: dict[tuple[str, str, str, int], list[Run]] = {}
    try:
        settings = [
            (answer, int(c))
            for answer in args.answers.split(",")
            for c in args.concurrency.split(",")
        ]
        turns = [(mode, name) for mode in args.modes.split(",") for name in targets]
        for answer, concurrency in settings:
            for r in range(args.rounds):
                for mode, name in turns[r % len(turns) :] + turns[: r % len(turns)]:
                    proc, port = procs[name]
                    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                        run = runner.run(drive(port, proc.pid, mode, answer, bodies, concurrency))
                    results.setdefault((answer, mode, name, concurrency), []).append(run)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait()
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    print("| answer | mode | target | streams in flight | decision p50 | requests/s "
          f"| picker CPU / request | × {baseline} full-duplex |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for (answer, mode, name, concurrency), runs in sorted(
        results.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][1])
    ):
        if runs[0].refused:
            print(f"| {answer} | {mode} | {name} | {concurrency} | refused "
                  f"({runs[0].refused}) | | | |")  # fmt: skip
            continue
        cpu = statistics.median(r.picker_cpu_s / len(r.decision_us) * 1e6 for r in runs)
        decision = statistics.median(statistics.median(r.decision_us) for r in runs)
        rate = statistics.median(len(r.decision_us) / r.wall_s for r in runs)
        base_runs = results.get((answer, "full-duplex", baseline, concurrency))
        ratio = ""
        if base_runs and not base_runs[0].refused:
            base = statistics.median(r.picker_cpu_s / len(r.decision_us) * 1e6 for r in base_runs)
            ratio = f"{cpu / base:.2f}"
        print(f"| {answer} | {mode} | {name} | {concurrency} | {decision:.0f} µs | {rate:.0f} "
              f"| {cpu:.0f} µs | {ratio} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
