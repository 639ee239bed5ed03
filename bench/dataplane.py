"""Data-plane CPU per request: servegate beside vllm-router, sglang-router and bare relays.

One run, loopback only, bounded in time (it stops by itself):

- replicas: one nginx (Debian `nginx-light`, one worker) serving canned OpenAI answers
  from `--replicas` ports per mode — a `/v1/completions` JSON answer, or a 16-event SSE
  stream — plus `/v1/models`, `/health` and a vLLM-shaped `/metrics`; pinned to the load
  core. `--backend fastbackend` uses servegate's fast backend instead (one process per
  replica, each chunk its own write);
- load: wrk (Debian `wrk`), one thread, pinned to the load core, POSTing
  `/v1/completions` with a ~1.5 kB prompt (8 shared prefixes, distinct tails), streaming
  or not;
- each target pinned with `taskset -c 0` (`--target-core`), started in front of the same
  replicas: servegate (`servegate serve --endpoint ...`: default profile, access log on),
  `vllm-router --policy cache_aware`, `sglang-router launch --policy cache_aware`, and
  the relays in bench/relays/; `servegate@SRC` runs another checkout's `src` (PYTHONPATH)
  as one more target, so two versions of servegate are measured side by side;
- CPU per request = (utime + stime of the target's process tree, /proc/<pid>/stat) /
  requests wrk completed, per segment; `--rounds` rounds, each visiting the targets in
  a rotated order; medians over rounds, ratios against the peers.

A row is flagged when the load core was saturated (wrk + replicas ≥ 90 % of a core: the
target may have been starved of load, its CPU per request then still counts), when its
rounds disagree by more than 15 % (max-min over median), when the machine's 1-minute
load average was above the core count, or on errors.

Peers and relay dependencies live in their own venv, never in the gateway's:

    python3 -m venv .venv-peers && .venv-peers/bin/pip install \\
        vllm-router==0.1.17 sglang-router==0.3.2 granian==2.8.9 httptools uvloop orjson aiohttp
    apt-get update && apt-get install -y wrk nginx-light
    .venv/bin/python bench/dataplane.py --peers .venv-peers/bin --rounds 3 --duration 5 \\
        --json bench/results/dataplane.json

(`make bench-dataplane` runs the same.)
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gateway_overhead import free_port, process_tree_cpu_s  # noqa: E402 (bench/ on sys.path)

LOOPBACK = "127.0.0.1"
MODEL = "fast"
NOISE_SPREAD = 0.15
SATURATED = 0.90
PEERS = ("vllm-router", "sglang-router")
DEFAULT_TARGETS = (
    "servegate",
    "vllm-router",
    "sglang-router",
    "relay-aiohttp",
    "relay-aiohttp-lean",
    "relay-granian",
    "relay-granian-lean",
    "relay-raw-lean",
)
SSE_CHUNKS = 16

# -- pure parts (unit-tested) ---------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(us|ms|s|m|h)")


def duration_ms(text: str) -> float:
    """wrk's `1.23ms` / `850.00us` / `1.02s` / `2.00m` as milliseconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match[1]) * _UNITS[match[2]]


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    req_per_s: float
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    non_2xx: int = 0
    socket_errors: int = 0


def parse_wrk(output: str) -> WrkResult:
    """The figures of one `wrk --latency` run."""
    requests = duration_s = req_per_s = None
    percentiles: dict[str, float] = {}
    non_2xx = socket_errors = 0
    in_distribution = False
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("Latency Distribution"):
            in_distribution = True
            continue
        if in_distribution:
            parts = line.split()
            if len(parts) == 2 and parts[0].endswith("%"):
                percentiles[parts[0]] = duration_ms(parts[1])
                continue
            in_distribution = False
        if " requests in " in line:
            count, _, rest = line.partition(" requests in ")
            requests = int(count)
            duration_s = duration_ms(rest.split(",")[0]) / 1000
        elif line.startswith("Requests/sec:"):
            req_per_s = float(line.split(":", 1)[1])
        elif line.startswith("Non-2xx or 3xx responses:"):
            non_2xx = int(line.split(":", 1)[1])
        elif line.startswith("Socket errors:"):
            for item in line.split(":", 1)[1].split(","):
                socket_errors += int(item.split()[-1])
    if requests is None or duration_s is None or req_per_s is None:
        raise ValueError(f"not wrk output:\n{output[-500:]}")
    return WrkResult(
        requests,
        duration_s,
        req_per_s,
        percentiles.get("50%"),
        percentiles.get("90%"),
        percentiles.get("99%"),
        non_2xx,
        socket_errors,
    )


def rotated(items: Sequence[str], round_index: int) -> list[str]:
    """Round r visits the targets starting at the r-th; odd rounds also reversed."""
    shift = round_index % len(items) if items else 0
    order = list(items[shift:]) + list(items[:shift])
    return order[::-1] if round_index % 2 else order


def spread(values: Sequence[float]) -> float:
    """(max - min) / median; 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


@dataclass
class Segment:
    """One target, one setting, one round."""

    target: str
    mode: str
    connections: int
    round_index: int
    requests: int
    wall_s: float
    target_cpu_s: float
    load_cpu_s: float
    """wrk + replicas: what ran on the load core."""
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    loadavg: float

    @property
    def cpu_us(self) -> float | None:
        return self.target_cpu_s / self.requests * 1e6 if self.requests else None

    @property
    def load_core_busy(self) -> float:
        return self.load_cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def target_core_busy(self) -> float:
        return self.target_cpu_s / self.wall_s if self.wall_s else 0.0


@dataclass
class Row:
    target: str
    mode: str
    connections: int
    rounds: int
    cpu_us: float | None
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    target_core_busy: float
    load_core_busy: float
    cpu_spread: float
    vs_vllm_router: float | None = None
    vs_sglang_router: float | None = None
    flags: list[str] = field(default_factory=list)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(segments: Sequence[Segment], cores: int) -> list[Row]:
    """Medians per (mode, connections, target), ratios against the peers, noise flags."""
    groups: dict[tuple[str, int, str], list[Segment]] = {}
    for segment in segments:
        groups.setdefault((segment.mode, segment.connections, segment.target), []).append(segment)
    rows: list[Row] = []
    for (mode, connections, target), group in groups.items():
        cpu = [s.cpu_us for s in group if s.cpu_us is not None]
        row = Row(
            target=target,
            mode=mode,
            connections=connections,
            rounds=len(group),
            cpu_us=_median(cpu),
            req_per_s=statistics.median(s.req_per_s for s in group),
            p50_ms=_median([s.p50_ms for s in group]),
            p99_ms=_median([s.p99_ms for s in group]),
            errors=sum(s.errors for s in group),
            target_core_busy=statistics.median(s.target_core_busy for s in group),
            load_core_busy=statistics.median(s.load_core_busy for s in group),
            cpu_spread=spread(cpu),
        )
        if row.cpu_spread > NOISE_SPREAD:
            row.flags.append(f"rounds disagree ({row.cpu_spread:.0%})")
        saturated = sum(1 for s in group if s.load_core_busy >= SATURATED)
        if saturated:
            row.flags.append(f"load core saturated ({saturated}/{len(group)})")
        busy = sum(1 for s in group if s.loadavg > cores)
        if busy:
            row.flags.append(f"machine load > {cores} ({busy}/{len(group)})")
        if row.errors:
            row.flags.append(f"{row.errors} errors")
        if len(group) < 3:
            row.flags.append("fewer than 3 rounds")
        rows.append(row)
    by_key = {(r.mode, r.connections, r.target): r for r in rows}
    for row in rows:
        for peer, attr in (
            ("vllm-router", "vs_vllm_router"),
            ("sglang-router", "vs_sglang_router"),
        ):
            base = by_key.get((row.mode, row.connections, peer))
            if base is not None and base.cpu_us and row.cpu_us is not None:
                setattr(row, attr, row.cpu_us / base.cpu_us)
    rows.sort(key=lambda r: (r.mode, r.connections, _target_rank(r.target)))
    return rows


def _target_rank(target: str) -> tuple[int, str]:
    known = list(DEFAULT_TARGETS)
    return (known.index(target), target) if target in known else (len(known), target)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def markdown(rows: Sequence[Row]) -> str:
    lines = [
        "| mode | conns | target | CPU µs/req | ×vllm-router | ×sglang-router | req/s "
        "| p50 ms | p99 ms | target core | load core | rounds | flags |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r.mode,
            str(r.connections),
            r.target,
            _fmt(r.cpu_us, ".0f"),
            _fmt(r.vs_vllm_router, ".2f"),
            _fmt(r.vs_sglang_router, ".2f"),
            _fmt(r.req_per_s, ".0f"),
            _fmt(r.p50_ms, ".2f"),
            _fmt(r.p99_ms, ".2f"),
            f"{r.target_core_busy:.0%}",
            f"{r.load_core_busy:.0%}",
            str(r.rounds),
            "; ".join(r.flags) or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- processes --------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 15)
        try:
            self.process.wait(8)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            self.process.wait(5)


def spawn(
    name: str, command: Sequence[str], log_dir: Path, core: int, env: dict[str, str] | None = None
) -> Proc:
    log = log_dir / (re.sub(r"[^\w.@-]", "_", name) + ".log")  # `servegate@/a/src` names
    with log.open("wb") as handle:
        process = subprocess.Popen(
            ["taskset", "-c", str(core), *command],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return Proc(name, process, log)


# -- replicas ---------------------------------------------------------------------------------


def canned(prompt_tokens: int = 400) -> tuple[bytes, bytes, bytes, bytes]:
    """(completion JSON, 16-event SSE stream, /v1/models, /metrics) answers."""
    created = 1_700_000_000
    base = {"id": "cmpl-fast", "object": "text_completion", "created": created, "model": MODEL}
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": SSE_CHUNKS,
        "total_tokens": prompt_tokens + SSE_CHUNKS,
    }
    whole = orjson.dumps(
        {
            **base,
            "choices": [{"index": 0, "text": "tok " * SSE_CHUNKS, "finish_reason": "length"}],
            "usage": usage,
        }
    )
    events = []
    for i in range(SSE_CHUNKS):
        last = i == SSE_CHUNKS - 1
        choice = {"index": 0, "text": "tok ", "finish_reason": "length" if last else None}
        events.append(b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    models = orjson.dumps(
        {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "owned_by": "bench", "max_model_len": 8192}],
        }
    )
    labels = f'engine="0",model_name="{MODEL}"'
    metrics = (
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} 0.0\n"
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} 0.0\n"
        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
    ).encode()
    return whole, b"".join(events), models, metrics


def _nginx_string(data: bytes) -> str:
    text = data.decode()
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def nginx_config(workdir: Path, json_ports: Sequence[int], sse_ports: Sequence[int]) -> str:
    whole, stream, models, metrics = canned()

    def server(port: int, answer: bytes, content_type: str) -> str:
        return f"""
    server {{
        listen {LOOPBACK}:{port} backlog=1024;
        keepalive_requests 1000000;
        location = /v1/completions {{ default_type {content_type}; return 200 {_nginx_string(answer)}; }}
        location = /v1/chat/completions {{ default_type {content_type}; return 200 {_nginx_string(answer)}; }}
        location = /v1/models {{ default_type application/json; return 200 {_nginx_string(models)}; }}
        location = /metrics {{ default_type text/plain; return 200 {_nginx_string(metrics)}; }}
        location = /health {{ return 200; }}
        location / {{ return 404; }}
    }}"""

    servers = [server(p, whole, "application/json") for p in json_ports]
    servers += [server(p, stream, "text/event-stream") for p in sse_ports]
    return f"""worker_processes 1;
daemon off;
master_process on;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_buffer_size 64k;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    keepalive_timeout 120s;
    {"".join(servers)}
}}
"""


@dataclass
class Replicas:
    procs: list[Proc]
    urls: dict[str, list[str]]

    def cpu_s(self) -> float:
        return sum(process_tree_cpu_s(p.process.pid) for p in self.procs)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def start_replicas(kind: str, count: int, log_dir: Path, core: int) -> Replicas:
    json_ports = [free_port() for _ in range(count)]
    sse_ports = [free_port() for _ in range(count)]
    urls = {
        "json": [f"http://{LOOPBACK}:{p}" for p in json_ports],
        "sse": [f"http://{LOOPBACK}:{p}" for p in sse_ports],
    }
    procs: list[Proc] = []
    if kind == "nginx":
        conf = log_dir / "nginx.conf"
        conf.write_text(nginx_config(log_dir, json_ports, sse_ports))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        procs.append(spawn("nginx", [nginx, "-c", str(conf), "-p", str(log_dir)], log_dir, core))
    else:
        for mode, ports in (("json", json_ports), ("sse", sse_ports)):
            for port in ports:
                command = [sys.executable, "-m", "servegate.testing.fastbackend", "--port"]
                command += [str(port), "--model", MODEL, "--chunks", str(SSE_CHUNKS)]
                procs.append(spawn(f"fastbackend-{mode}-{port}", command, log_dir, core))
    replicas = Replicas(procs, urls)
    for url in urls["json"] + urls["sse"]:
        problem = wait_answering(url, stream=url in urls["sse"], timeout_s=20)
        if problem:
            replicas.stop()
            tails = "\n".join(p.tail() for p in procs)
            raise RuntimeError(f"replica {url} not answering: {problem}\n{tails}")
    return replicas


# -- targets ----------------------------------------------------------------------------------


def target_command(
    target: str, port: int, upstreams: Sequence[str], peers: Path, servegate: str
) -> tuple[list[str], dict[str, str]]:
    python = str(peers / "python")
    if target == "servegate":
        command = [*shlex.split(servegate), "serve", "--port", str(port), "--host", LOOPBACK]
        for url in upstreams:
            command += ["--endpoint", url]
        return command, {}
    if target.startswith("servegate@"):  # another checkout's src, side by side (A/B)
        command = [sys.executable, "-m", "servegate.cli", "serve", "--port", str(port)]
        command += ["--host", LOOPBACK]
        for url in upstreams:
            command += ["--endpoint", url]
        return command, {"PYTHONPATH": target.partition("@")[2]}
    if target == "vllm-router":
        command = [str(peers / "vllm-router"), "--host", LOOPBACK, "--port", str(port)]
        command += ["--prometheus-port", str(free_port())]  # metrics on, as by default
        return [*command, "--policy", "cache_aware", "--worker-urls", *upstreams], {}
    if target == "sglang-router":
        command = [str(peers / "sglang-router"), "launch", "--host", LOOPBACK]
        command += ["--port", str(port), "--prometheus-port", str(free_port())]
        return [*command, "--policy", "cache_aware", "--worker-urls", *upstreams], {}
    relay = str(HERE / "relays" / "relay.py")
    ups = [arg for url in upstreams for arg in ("--upstream", url)]
    base = [python, relay, "--host", LOOPBACK, "--port", str(port), *ups]
    if target == "relay-aiohttp":
        return [*base, "--server", "aiohttp", "--client", "aiohttp"], {}
    if target == "relay-aiohttp-lean":
        return [*base, "--server", "aiohttp", "--client", "lean"], {}
    if target == "relay-raw-lean":
        return [*base, "--server", "raw", "--client", "lean"], {}
    if target in ("relay-granian", "relay-granian-lean"):
        command = [str(peers / "granian"), "--interface", "rsgi", "--loop", "uvloop"]
        command += ["--workers", "1", "--runtime-threads", "1", "--no-ws", "--no-log"]
        command += ["--host", LOOPBACK, "--port", str(port), "--backlog", "1024"]
        command += ["--working-dir", str(HERE / "relays"), "granian_relay:app"]
        env = {
            "RELAY_UPSTREAMS": ",".join(upstreams),
            "RELAY_CLIENT": "lean" if target.endswith("-lean") else "aiohttp",
        }
        return command, env
    raise ValueError(f"unknown target {target!r}")


def request_body(prompt: str, stream: bool) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": SSE_CHUNKS, "stream": stream}
    )


def prompts(count: int = 32, chars: int = 1500) -> list[str]:
    """8 shared prefixes (~1 kB) with distinct tails, ~`chars` characters each."""
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
    out = []
    for i in range(count):
        prefix = f"System {i % 8}: " + " ".join(words[(i + k) % 8] for k in range(160))
        tail = f" question {i}: " + " ".join(words[(i * 7 + k) % 8] for k in range(80))
        out.append((prefix + tail)[:chars].ljust(chars, "."))
    return out


def wait_answering(url: str, *, stream: bool, timeout_s: float) -> str | None:
    """None once a POST /v1/completions answers 200 with the whole body."""
    deadline = time.monotonic() + timeout_s
    host, port = url.removeprefix("http://").split(":")
    body = request_body("ping", stream)
    last = "no answer"
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            if response.status == 200 and (not stream or data.rstrip().endswith(b"[DONE]")):
                return None
            last = f"{response.status}: {data[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        finally:
            conn.close()
        time.sleep(0.3)
    return last


def start_target(
    target: str, upstreams: Sequence[str], args: argparse.Namespace, log_dir: Path, mode: str
) -> Proc | None:
    port = free_port()
    command, env = target_command(target, port, upstreams, args.peers, args.servegate)
    name = f"{target}-{mode}"
    proc = spawn(name, command, log_dir, args.target_core, env)
    proc.url = f"http://{LOOPBACK}:{port}"
    problem = wait_answering(proc.url, stream=mode == "sse", timeout_s=args.startup_timeout)
    if problem is not None:
        print(f"{name} skipped: {shlex.join(command)}: {problem}\n{proc.tail()}", file=sys.stderr)
        proc.stop()
        return None
    print(f"{name}: {shlex.join(command)}", file=sys.stderr)
    return proc


# -- load -------------------------------------------------------------------------------------


def wrk_script(path: Path, stream: bool) -> Path:
    bodies = [request_body(p, stream).decode() for p in prompts()]
    lua_bodies = ",\n".join("[==[" + b + "]==]" for b in bodies)
    path.write_text(
        f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {{
{lua_bodies}
}}
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, "/v1/completions", nil, bodies[i])
end
"""
    )
    return path


def run_wrk(
    url: str, connections: int, duration_s: float, script: Path, core: int
) -> tuple[str, float]:
    """wrk's output and its own CPU seconds."""
    command = [
        "taskset",
        "-c",
        str(core),
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
    ]
    command += ["--latency", "--timeout", "10s", "-s", str(script), url]
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed ({process.returncode}): {text[-500:]}")
    return text, usage.ru_utime + usage.ru_stime


def measure_segment(
    target: str,
    proc: Proc,
    replicas: Replicas,
    mode: str,
    connections: int,
    round_index: int,
    args: argparse.Namespace,
    script: Path,
) -> Segment:
    loadavg = os.getloadavg()[0]
    cpu0 = process_tree_cpu_s(proc.process.pid)
    backend0 = replicas.cpu_s()
    t0 = time.monotonic()
    output, wrk_cpu = run_wrk(proc.url, connections, args.duration, script, args.load_core)
    wall = time.monotonic() - t0
    target_cpu = process_tree_cpu_s(proc.process.pid) - cpu0
    backend_cpu = replicas.cpu_s() - backend0
    result = parse_wrk(output)
    return Segment(
        target=target,
        mode=mode,
        connections=connections,
        round_index=round_index,
        requests=result.requests,
        wall_s=wall,
        target_cpu_s=target_cpu,
        load_cpu_s=wrk_cpu + backend_cpu,
        req_per_s=result.req_per_s,
        p50_ms=result.p50_ms,
        p99_ms=result.p99_ms,
        errors=result.non_2xx + result.socket_errors,
        loadavg=max(loadavg, os.getloadavg()[0]),
    )


def run(args: argparse.Namespace) -> tuple[list[Segment], list[Row]]:
    for tool in ("wrk", "taskset") + (("nginx",) if args.backend == "nginx" else ()):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(
                f"{tool} not found: apt-get update && apt-get install -y wrk nginx-light"
            )
    segments: list[Segment] = []
    deadline = time.monotonic() + args.max_minutes * 60
    with tempfile.TemporaryDirectory(prefix="servegate-dataplane-") as tmp:
        log_dir = Path(tmp)
        replicas = start_replicas(args.backend, args.replicas, log_dir, args.load_core)
        try:
            for mode in args.modes:
                script = wrk_script(log_dir / f"{mode}.lua", stream=mode == "sse")
                procs: dict[str, Proc] = {}
                try:
                    for target in args.targets:
                        proc = start_target(target, replicas.urls[mode], args, log_dir, mode)
                        if proc is not None:
                            procs[target] = proc
                    for proc in procs.values():  # warm-up: pools, JIT-less caches, tree inserts
                        run_wrk(
                            proc.url, max(args.connections), args.warmup, script, args.load_core
                        )
                    names = list(procs)
                    for round_index in range(args.rounds):
                        for connections in args.connections:
                            for target in rotated(names, round_index):
                                if time.monotonic() > deadline:
                                    print("time limit reached; stopping early", file=sys.stderr)
                                    return segments, summarise(segments, os.cpu_count() or 1)
                                segment = measure_segment(
                                    target, procs[target], replicas, mode, connections,
                                    round_index, args, script,
                                )  # fmt: skip
                                segments.append(segment)
                                print(
                                    f"round {round_index} {mode} c={connections} {target}: "
                                    f"{_fmt(segment.cpu_us, '.0f')} µs/req, "
                                    f"{segment.req_per_s:.0f} req/s, load core "
                                    f"{segment.load_core_busy:.0%}, loadavg {segment.loadavg:.1f}",
                                    file=sys.stderr,
                                    flush=True,
                                )
                finally:
                    for proc in procs.values():
                        if proc.process.poll() is not None:
                            print(f"{proc.name} died:\n{proc.tail()}", file=sys.stderr)
                        proc.stop()
        finally:
            replicas.stop()
    return segments, summarise(segments, os.cpu_count() or 1)


def _levels(value: str) -> list[int]:
    levels = [int(v) for v in value.split(",") if v.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("connection counts are whole numbers >= 1, e.g. 1,16,64")
    return levels


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--peers", type=Path, default=Path(".venv-peers/bin"))
    parser.add_argument(
        "--servegate",
        default=str(Path(sys.executable).parent / "servegate"),
        help="command that runs servegate's CLI (shell words), e.g. 'python -m servegate.cli'",
    )
    parser.add_argument("--targets", type=_names, default=list(DEFAULT_TARGETS))
    parser.add_argument("--modes", type=_names, default=["json", "sse"])
    parser.add_argument("--connections", type=_levels, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per segment")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--backend", choices=["nginx", "fastbackend"], default="nginx")
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1)
    parser.add_argument("--startup-timeout", type=float, default=60.0)
    parser.add_argument("--max-minutes", type=float, default=30.0, help="stop measuring after")
    parser.add_argument("--json", type=Path, help="also write segments and rows here")
    args = parser.parse_args(argv)
    args.peers = args.peers.resolve()
    unknown = [m for m in args.modes if m not in ("json", "sse")]
    if unknown:
        parser.error(f"--modes takes json and/or sse, not {unknown}")
    segments, rows = run(args)
    print(markdown(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "segments": [{**asdict(s), "cpu_us": s.cpu_us} for s in segments],
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
