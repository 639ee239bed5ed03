"""What the gateway adds: latency, throughput and CPU per request against a fast backend.

Starts `servegate.testing.fastbackend` (canned answers, near-zero cost) and the
gateway in front of it, each in its own process, then sends the same requests
directly to the backend and through the gateway, alternating in rounds, at each
concurrency, streaming and not. This process is the load generator, so its CPU is
never counted as the gateway's. Reports p50/p99 end-to-end latency, requests/s, the
added p50/p99 (gateway - direct) and CPU per request of the gateway's process tree
and of the backend, from /proc/<pid>/stat (utime + stime, 10 ms resolution; totals
over all rounds keep the error to a few percent at ~1000 requests).

    .venv/bin/python bench/gateway_overhead.py                     # servegate serve
    .venv/bin/python bench/gateway_overhead.py --requests 600 --concurrency 1,32 \\
        --gateway-cmd '{python} -m servegate.testing.fastbackend --port {port}'  # self-test

`--gateway-cmd` is a template: `{backend}` (backend URL), `{backend_port}`, `{port}`
(a free port for the gateway) and `{python}` are filled in. When the gateway does not
start or does not answer, the gateway rows are skipped with the reason and its log.
`--compare NAME=TEMPLATE` (repeatable) starts more gateways in front of the same
backend and measures them in the same rounds, alternating with the others, so two
versions compare side by side:

    .venv/bin/python bench/gateway_overhead.py --concurrency 1,32 --compare \\
        'baseline=env PYTHONPATH=/tmp/old/src {python} -m servegate.cli serve \\
        --endpoint {backend} --port {port}'

`--fronts` adds servegate's request path behind other HTTP servers (`bench/fronts/`,
run from the repository root; granian and uvicorn are not servegate dependencies:
`.venv/bin/pip install granian==2.8.9 'uvicorn[standard]'`), and `--pin CORE` runs every
gateway under `taskset -c CORE`, so CPU per request is one core's:

    .venv/bin/python bench/gateway_overhead.py --concurrency 1,16 --requests 1500 \
        --pin 1 --fronts granian-asgi,granian-rsgi,uvicorn

At high concurrency the Python load generator itself saturates a core; compare rows
at the same concurrency, not across concurrencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson

from servegate.bench.client import RequestResult, send_request
from servegate.bench.runner import LoadKind, LoadPoint, SendOptions, run_segment
from servegate.bench.stats import percentile
from servegate.bench.workloads import BenchRequest, ChatMessage

MODEL = "fast"
DEFAULT_GATEWAY_CMD = "{servegate} serve --endpoint {backend} --port {port}"
_GRANIAN = (
    "env FRONT_ENDPOINT={backend} {python} -m granian --interface %s --workers 1 "
    "--runtime-threads 1 --loop uvloop --no-ws --log-level warning --working-dir bench/fronts "
    "--host 127.0.0.1 --port {port} --factory fronts:%s_app"
)
FRONTS = {
    "granian-asgi": _GRANIAN % ("asgi", "asgi"),
    "granian-rsgi": _GRANIAN % ("rsgi", "rsgi"),
    "granian-rsgi-nowatch": "env FRONT_WATCH=0 " + _GRANIAN % ("rsgi", "rsgi"),
    "granian-rsgi-callback": "env FRONT_WATCH=callback " + _GRANIAN % ("rsgi", "rsgi"),
    "uvicorn": (
        "env FRONT_ENDPOINT={backend} {python} -m uvicorn --loop uvloop --http httptools "
        "--no-access-log --log-level warning --app-dir bench/fronts --host 127.0.0.1 "
        "--port {port} --factory fronts:asgi_app"
    ),
}
"""Server fronts over servegate's request path (`bench/fronts/fronts.py`), by name."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) is in parentheses and may hold spaces; split after it.
    return raw[raw.rindex(")") + 2 :].split()


def process_tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and its live descendants, in seconds."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total_ticks = 0
    pending = [root]
    while pending:
        pid = pending.pop()
        fields = _stat_fields(pid)
        if fields is None:
            continue
        total_ticks += int(fields[11]) + int(fields[12])
        pending.extend(children.get(pid, ()))
    return total_ticks / CLOCK_TICKS


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def spawn(name: str, command: Sequence[str], log_dir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = log_dir / f"{name}.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            list(command), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log


def start_backend(log_dir: Path, chunks: int, timeout_s: float) -> Server:
    command = [
        sys.executable,
        "-m",
        "servegate.testing.fastbackend",
        "--port",
        "0",
        "--model",
        MODEL,
        "--chunks",
        str(chunks),
    ]
    process, log = spawn("backend", command, log_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("listening on "):
                return Server("backend", process, line.removeprefix("listening on "), log)
        time.sleep(0.05)
    server = Server("backend", process, "", log)
    server.stop()
    raise RuntimeError(f"fast backend did not start within {timeout_s} s:\n{server.tail()}")


def probe_request() -> BenchRequest:
    return BenchRequest(MODEL, 8, messages=(ChatMessage("user", "ping"),))


async def wait_answering(server: Server, timeout_s: float) -> str | None:
    """None once `server` answers a chat request with 200; else why it did not."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return f"exited with code {server.process.returncode}"
            result = await send_request(
                session, server.url, probe_request(), stream=False, timeout_s=5
            )
            if result.ok:
                return None
            last = f"{result.error_kind}: {result.error}"
            await asyncio.sleep(0.2)
    return f"no 200 answer within {timeout_s} s (last: {last})"


def start_gateway(
    template: str, backend: Server, log_dir: Path, timeout_s: float, name: str = "gateway"
) -> tuple[Server | None, str]:
    port = free_port()
    servegate = Path(sys.executable).parent / "servegate"
    fields = {
        "backend": backend.url,
        "backend_port": backend.url.rsplit(":", 1)[1],
        "port": str(port),
        "python": sys.executable,
        "servegate": str(servegate) if servegate.exists() else "servegate",
    }
    command = shlex.split(template.format(**fields))
    try:
        process, log = spawn(name, command, log_dir)
    except OSError as exc:
        return None, f"cannot run {shlex.join(command)}: {exc}"
    server = Server(name, process, f"http://{LOOPBACK}:{port}", log)
    problem = asyncio.run(wait_answering(server, timeout_s))
    if problem is not None:
        server.stop()
        return None, f"{shlex.join(command)}: {problem}\n{server.tail()}"
    return server, shlex.join(command)


@dataclass
class Row:
    stream: bool
    concurrency: int
    path: str
    requests: int = 0
    errors: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    req_per_s: float = 0.0
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    gateway_cpu_us: float | None = None
    backend_cpu_us: float | None = None


@dataclass
class _Tally:
    results: list[RequestResult]
    wall_s: float = 0.0
    gateway_cpu_s: float = 0.0
    backend_cpu_s: float = 0.0


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else value * 1000


def requests_for(count: int) -> list[BenchRequest]:
    prompt = " ".join(["word"] * 64)
    return [
        BenchRequest(MODEL, 8, messages=(ChatMessage("user", f"{i} {prompt}"),))
        for i in range(count)
    ]


async def measure(
    servers: dict[str, Server],
    backend: Server,
    *,
    stream: bool,
    concurrency: int,
    requests: int,
    rounds: int,
    max_segment_s: float,
) -> list[Row]:
    batch = requests_for(max(1, requests // rounds))
    point = LoadPoint(LoadKind.CONCURRENCY, concurrency)
    options = SendOptions(stream=stream, timeout_s=30.0)
    tallies = {name: _Tally([]) for name in servers}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for server in servers.values():
            warm = requests_for(min(1000, max(concurrency * 2, 50)))
            await run_segment(session, server.url, warm, point, options=options, duration_s=10)
        for round_index in range(rounds):
            names = list(servers)
            if round_index % 2:
                names.reverse()
            for name in names:
                tally = tallies[name]
                gateway = servers[name] if servers[name] is not backend else None
                gw_before = process_tree_cpu_s(gateway.process.pid) if gateway else 0.0
                be_before = process_tree_cpu_s(backend.process.pid)
                segment = await run_segment(
                    session,
                    servers[name].url,
                    batch,
                    point,
                    options=options,
                    duration_s=max_segment_s,
                )
                if gateway is not None:
                    tally.gateway_cpu_s += process_tree_cpu_s(gateway.process.pid) - gw_before
                tally.backend_cpu_s += process_tree_cpu_s(backend.process.pid) - be_before
                tally.results.extend(segment.results)
                tally.wall_s += segment.wall_s
    rows = []
    for name, tally in tallies.items():
        ok = [r.e2e_s for r in tally.results if r.ok]
        served = len(tally.results)
        rows.append(
            Row(
                stream=stream,
                concurrency=concurrency,
                path=name,
                requests=served,
                errors=served - len(ok),
                p50_ms=_ms(ok, 50),
                p99_ms=_ms(ok, 99),
                req_per_s=len(ok) / tally.wall_s if tally.wall_s else 0.0,
                gateway_cpu_us=tally.gateway_cpu_s / served * 1e6
                if served and servers[name] is not backend
                else None,
                backend_cpu_us=tally.backend_cpu_s / served * 1e6 if served else None,
            )
        )
    direct = rows[0]
    for row in rows[1:]:
        row.added_p50_ms = _diff(row.p50_ms, direct.p50_ms)
        row.added_p99_ms = _diff(row.p99_ms, direct.p99_ms)
    return rows


def _diff(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: Sequence[Row]) -> str:
    header = (
        "| stream | concurrency | path | requests | errors | p50 ms | p99 ms | req/s "
        "| added p50 ms | added p99 ms | gateway CPU µs/req | backend CPU µs/req |"
    )
    lines = [header, "|" + "---|" * 12]
    for row in rows:
        cells = [
            "yes" if row.stream else "no",
            str(row.concurrency),
            row.path,
            str(row.requests),
            str(row.errors),
            _fmt(row.p50_ms, 3),
            _fmt(row.p99_ms, 3),
            _fmt(row.req_per_s, 0),
            _fmt(row.added_p50_ms, 3),
            _fmt(row.added_p99_ms, 3),
            _fmt(row.gateway_cpu_us, 0),
            _fmt(row.backend_cpu_us, 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_concurrency(value: str) -> list[int]:
    levels = [int(v) for v in value.split(",") if v.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels are whole numbers >= 1, e.g. 1,32,256")
    return levels


def parse_named_command(value: str) -> tuple[str, str]:
    name, sep, template = value.partition("=")
    name = name.strip()
    if not sep or not name or not template.strip() or name in {"direct", "gateway"}:
        raise argparse.ArgumentTypeError(
            "--compare takes NAME=TEMPLATE with a name other than 'direct' and 'gateway', "
            "e.g. 'baseline={python} -m servegate.cli serve --endpoint {backend} --port {port}'"
        )
    return name, template


def parse_fronts(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [name for name in names if name not in FRONTS]
    if unknown or not names:
        named = ", ".join(unknown) if unknown else repr(value)
        raise argparse.ArgumentTypeError(f"unknown front {named}; known: {', '.join(FRONTS)}")
    return names


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gateway-cmd", default=DEFAULT_GATEWAY_CMD)
    parser.add_argument("--no-gateway", action="store_true", help="measure the backend only")
    parser.add_argument("--concurrency", type=parse_concurrency, default=[1, 32, 256])
    parser.add_argument("--requests", type=int, default=3000, help="per path and setting")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=8, help="SSE chunks per streamed answer")
    parser.add_argument("--max-segment-s", type=float, default=60.0)
    parser.add_argument("--startup-timeout", type=float, default=30.0)
    parser.add_argument("--stream", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--compare",
        type=parse_named_command,
        action="append",
        default=[],
        metavar="NAME=TEMPLATE",
        help="another gateway to measure in the same rounds (repeatable)",
    )
    parser.add_argument(
        "--fronts",
        type=parse_fronts,
        default=[],
        metavar="NAME[,NAME]",
        help=f"servegate behind other servers, measured like --compare: {', '.join(FRONTS)}",
    )
    parser.add_argument(
        "--pin", type=int, metavar="CORE", help="run each gateway under `taskset -c CORE`"
    )
    args = parser.parse_args(argv)
    args.compare += [(name, FRONTS[name]) for name in args.fronts]
    if args.pin is not None:
        pin = f"taskset -c {args.pin} "
        args.gateway_cmd = pin + args.gateway_cmd
        args.compare = [(name, pin + template) for name, template in args.compare]
    names = [name for name, _ in args.compare]
    if len(set(names)) != len(names):
        parser.error(f"--compare names must differ: {', '.join(names)}")
    streams = {"both": [False, True], "yes": [True], "no": [False]}[args.stream]
    with tempfile.TemporaryDirectory(prefix="servegate-overhead-") as tmp:
        log_dir = Path(tmp)
        backend = start_backend(log_dir, args.chunks, args.startup_timeout)
        servers = {"direct": backend}
        gateways: list[Server] = []
        commands = [] if args.no_gateway else [("gateway", args.gateway_cmd), *args.compare]
        try:
            for name, template in commands:
                gateway, detail = start_gateway(
                    template, backend, log_dir, args.startup_timeout, name
                )
                if gateway is None:
                    print(f"{name} skipped: {detail}", file=sys.stderr)
                else:
                    print(f"{name}: {detail}", file=sys.stderr)
                    servers[name] = gateway
                    gateways.append(gateway)
            rows: list[Row] = []
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                for stream in streams:
                    for concurrency in args.concurrency:
                        print(f"measuring stream={stream} c={concurrency} ...", file=sys.stderr)
                        rows += runner.run(
                            measure(
                                servers,
                                backend,
                                stream=stream,
                                concurrency=concurrency,
                                requests=args.requests,
                                rounds=args.rounds,
                                max_segment_s=args.max_segment_s,
                            )
                        )
        finally:
            for gateway in gateways:
                gateway.stop()
            backend.stop()
    print(markdown(rows))
    if args.json:
        args.json.write_bytes(orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
