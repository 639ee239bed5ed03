"""CPU per request of servegate's own request path, with no sockets: A/B two checkouts.

`serve_inference` (the Director: parse, admission, tokenisation, scheduling, latency
learning, lease; the proxy: headers, relay; the bookkeeping: metrics, access log) driven
in a loop through the in-memory transport and a recording sink, on the default profile
with two endpoints and a ~1.5 kB completion prompt (8 shared prefixes, distinct tails),
JSON or an 8-event SSE stream. No HTTP server, no upstream client, no syscalls per
request: what is left is the Python work this code owns, which is what a change to it
moves. CPU is `time.process_time` over `--requests` requests, after a warm-up, per
repeat; the minimum over `--repeats` is the figure (noise on a shared machine only ever
adds). `--compare` runs other checkouts' `src` in alternating subprocesses:

    .venv/bin/python bench/request_path_cpu.py --compare main=/tmp/main/src \\
        --compare new=src --passes 3 [--stream] [--pin 1]

(with no `--compare`, one in-process run of the installed servegate). Benchmark only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000")
ANSWER = orjson.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "hello world " * 8, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 16, "total_tokens": 316},
    }
)
EVENTS = [b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(8)]
SSE = (*EVENTS, b"data: [DONE]\n\n")


async def measure(requests: int, repeats: int, stream: bool) -> tuple[float, float]:
    from servegate.cli import _overrides
    from servegate.config import GatewaySettings, parse_config
    from servegate.gateway.app import build_gateway
    from servegate.gateway.inference import serve_inference
    from servegate.scheduling.request import RequestKind
    from servegate.testing.sink import RecordingSink
    from servegate.testing.transport import InMemoryTransport, Reply

    urls = [f"http://{a}" for a in ENDPOINTS]
    overrides = _overrides(urls, None, None, "m", None, None)
    config = parse_config("", "<bench>", environ={}, overrides=overrides)
    if stream:
        reply = Reply(chunks=SSE, headers={"Content-Type": "text/event-stream"})
    else:
        reply = Reply(chunks=(ANSWER,))
    transport = InMemoryTransport(dict.fromkeys(ENDPOINTS, reply))
    director = build_gateway(config, None, io.BytesIO(), transport=transport).director
    for runtime in director.snapshot.runtimes:
        for address in ENDPOINTS:
            runtime.state.pool.set_health(address, True)
    prefixes = [f"You are a helpful assistant number {i}. " * 30 for i in range(8)]
    bodies = [
        orjson.dumps(
            {
                "model": "m",
                "prompt": f"{prefixes[i % 8]}tail {i}",
                "max_tokens": 16,
                "stream": stream,
            }
        )
        for i in range(512)
    ]
    headers = CIMultiDictProxy(
        CIMultiDict(
            [
                ("Host", "gateway:8080"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(bodies[0]))),
                ("User-Agent", "wrk"),
                ("Accept", "*/*"),
            ]
        )
    )

    async def one(body: bytes) -> None:
        async def read_body(settings: GatewaySettings) -> bytes:
            return body

        error = await serve_inference(
            director,
            RecordingSink(),
            RequestKind.COMPLETION,
            "POST",
            "/v1/completions",
            headers,
            read_body,
        )
        if error is not None:
            raise RuntimeError(f"the request failed: {error}")
        transport.sent.clear()
        transport.responses.clear()

    for i in range(2000):
        await one(bodies[i % 512])
    runs = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.process_time()
        for i in range(requests):
            await one(bodies[i % 512])
        runs.append((time.process_time() - t0) / requests * 1e6)
    runs.sort()
    return runs[0], runs[len(runs) // 2]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop, as the gateway runs on, when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_here(args: argparse.Namespace) -> None:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        best, median = runner.run(measure(args.requests, args.repeats, args.stream))
    print(f"{best:.1f} {median:.1f}")


def compare(args: argparse.Namespace, sources: Sequence[tuple[str, str]]) -> None:
    own = [sys.executable, os.path.abspath(__file__), "--requests", str(args.requests)]
    own += ["--repeats", str(args.repeats)] + (["--stream"] if args.stream else [])
    pin = ["taskset", "-c", str(args.pin)] if args.pin is not None else []
    results: dict[str, list[float]] = {name: [] for name, _ in sources}
    for p in range(args.passes):
        for name, src in sources:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            out = subprocess.run(
                pin + own, env=env, capture_output=True, text=True, check=True
            ).stdout.split()
            results[name].append(float(out[-2]))
            print(f"pass {p + 1} {name}: min {out[-2]} µs, median {out[-1]} µs", file=sys.stderr)
    base_name = sources[0][0]
    print("| checkout | min µs/req per pass | ratio to " + base_name + " per pass |")
    print("|---|---|---|")
    for name, values in results.items():
        ratios = [v / b for v, b in zip(values, results[base_name], strict=True)]
        print(
            f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} | "
            f"{' / '.join(f'{r:.3f}' for r in ratios)} |"
        )


def parse_source(value: str) -> tuple[str, str]:
    name, sep, src = value.partition("=")
    if not sep or not name or not src:
        raise argparse.ArgumentTypeError("--compare takes NAME=SRC, e.g. main=/tmp/main/src")
    return name, src


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stream", action="store_true", help="an SSE answer, not JSON")
    parser.add_argument("--compare", type=parse_source, action="append", default=[])
    parser.add_argument("--passes", type=int, default=3, help="alternations with --compare")
    parser.add_argument("--pin", type=int, metavar="CORE", help="taskset -c CORE per run")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args, args.compare)
    else:
        run_here(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
