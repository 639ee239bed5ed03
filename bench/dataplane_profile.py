"""Where servegate's CPU per request goes: py-spy samples folded into components.

Starts `--replicas` fast backends (servegate.testing.fastbackend, pinned to the load
core) and `servegate serve` in front of them (pinned to `--target-core`, default
profile, access log on), then per mode (JSON, 16-chunk SSE):

1. warms up with wrk;
2. measures CPU per request without the profiler: utime + stime of servegate's process
   tree over a wrk run of `--duration` seconds, divided by the requests wrk completed;
3. records `py-spy record --nonblocking` (`--native`: native frames too, pausing the
   process per sample) over a second run and folds every sample into one component:
   walking each stack from the leaf to the root, the first frame a rule claims decides
   (so `orjson.loads` inside `parse.py` is parse, a socket send under aiohttp's client is
   the client). Samples with no claiming frame are the event loop itself (uvloop, task
   switching); samples waiting in epoll are idle and dropped;
4. prints µs per request per component = its share of samples × the unprofiled CPU
   per request.

    .venv/bin/python bench/dataplane_profile.py --py-spy .venv-peers/bin/py-spy \\
        --duration 10 --connections 16 [--servegate 'python -m servegate.cli'] \\
        [--keep-raw /tmp/profile]

py-spy needs ptrace (root, or CAP_SYS_PTRACE). Benchmark only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent

# (component, substrings of a "function (file:line)" frame), checked in this order per frame.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("access log", ("servegate/gateway/logging.py",)),
    ("metrics", ("servegate/gateway/metrics.py", "prometheus_client/")),
    ("parse", ("servegate/gateway/parse.py",)),
    ("auth", ("servegate/gateway/tenants.py", "_authorise (")),
    (
        "admission + flow control",
        ("servegate/gateway/admission.py", "servegate/scheduling/flowcontrol/"),
    ),
    (
        "routing + scheduling",
        (
            "servegate/scheduling/",
            "servegate/gateway/cache_routing.py",
            "servegate/gateway/model_routing.py",
            "servegate/gateway/pools.py",
            "servegate/gateway/latency.py",
            "servegate/gateway/routing_signals.py",
            "servegate/pool/",
        ),
    ),
    (
        "proxy / relay (servegate)",
        (
            "servegate/gateway/proxy.py",
            "servegate/gateway/headers.py",
            "servegate/gateway/retry.py",
        ),
    ),
    ("connection guard (connections.py)", ("servegate/gateway/connections.py",)),
    (
        "background (scrape, health, KV events)",
        ("servegate/datalayer/", "servegate/engines/", "servegate/scaleout/"),
    ),
    ("handler glue (app.py, errors)", ("servegate/gateway/", "servegate/")),
    ("aiohttp client", ("aiohttp/client", "aiohttp/connector.py", "aiohttp/tracing.py")),
    ("aiohttp server", ("aiohttp/web_",)),
)
# Entry points under every sample: never claim one.
UNCLAIMED = ("servegate/cli.py", "servegate/gateway/server.py", "typer/", "asyncio/runners.py")
GC_FRAMES = ("gc_collect_main", "gc_collect_with_callback", "collect_generations", "gc_collect")
IDLE_LEAVES = ("epoll_wait", "epoll_pwait")
EVENT_LOOP = "event loop (uvloop, epoll, task switching)"
GC = "garbage collection"


def classify(frames: Sequence[str]) -> str:
    """The component one sample (frames root first, leaf last) belongs to."""
    if any(marker in frame for frame in frames for marker in GC_FRAMES):
        return GC
    for frame in reversed(frames):
        if any(marker in frame for marker in UNCLAIMED):
            continue
        for component, markers in RULES:
            if any(marker in frame for marker in markers):
                return component
    return EVENT_LOOP


def fold(lines: Iterable[str]) -> Counter[str]:
    """py-spy's raw (collapsed) output, `frame;frame;... count` lines, per component."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(idle in frames[-1] for idle in IDLE_LEAVES):
            continue  # waiting in epoll: not CPU
        counts[classify(frames)] += int(count)
    return counts


def table(counts: Counter[str], cpu_us: float) -> list[tuple[str, int, float, float]]:
    """(component, samples, share, µs per request), largest first."""
    total = sum(counts.values())
    if not total:
        return []
    return [(name, n, n / total, n / total * cpu_us) for name, n in counts.most_common()]


def _load_dataplane() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dataplane_bench", HERE / "dataplane.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dataplane_bench"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--py-spy", default=".venv-peers/bin/py-spy")
    parser.add_argument("--servegate", default=str(Path(sys.executable).parent / "servegate"))
    parser.add_argument("--extra", default="", help="more `servegate serve` arguments")
    parser.add_argument("--modes", default="json,sse")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1)
    parser.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="native frames too (py-spy then pauses the process per sample: on a loaded "
        "machine samples pile up where the process was stopped, so off by default)",
    )
    parser.add_argument("--keep-raw", type=Path, help="copy py-spy's raw stacks here")
    args = parser.parse_args(argv)
    dp = _load_dataplane()
    with tempfile.TemporaryDirectory(prefix="servegate-profile-") as tmp:
        log_dir = Path(tmp)
        replicas = dp.start_replicas("fastbackend", args.replicas, log_dir, args.load_core)
        try:
            for mode in args.modes.split(","):
                port = dp.free_port()
                command = [*shlex.split(args.servegate), "serve", "--host", dp.LOOPBACK]
                command += ["--port", str(port), *shlex.split(args.extra)]
                for url in replicas.urls[mode]:
                    command += ["--endpoint", url]
                proc = dp.spawn(f"servegate-{mode}", command, log_dir, args.target_core)
                proc.url = f"http://{dp.LOOPBACK}:{port}"
                try:
                    problem = dp.wait_answering(proc.url, stream=mode == "sse", timeout_s=60)
                    if problem:
                        raise RuntimeError(f"servegate did not answer: {problem}\n{proc.tail()}")
                    script = dp.wrk_script(log_dir / f"{mode}.lua", stream=mode == "sse")
                    dp.run_wrk(proc.url, args.connections, 3, script, args.load_core)
                    cpu0 = dp.process_tree_cpu_s(proc.process.pid)
                    out, _ = dp.run_wrk(
                        proc.url, args.connections, args.duration, script, args.load_core
                    )
                    plain = dp.parse_wrk(out)
                    cpu_us = (dp.process_tree_cpu_s(proc.process.pid) - cpu0) / plain.requests * 1e6
                    raw = log_dir / f"{mode}.raw"
                    wrk = subprocess.Popen(
                        ["taskset", "-c", str(args.load_core), "wrk", "-t1",
                         f"-c{args.connections}", f"-d{args.duration + 2}s", "-s", str(script),
                         proc.url],
                        stdout=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(1)
                    spy = [args.py_spy, "record", "--pid", str(proc.process.pid), "--rate"]
                    spy += [str(args.rate), "--duration", str(args.duration)]
                    spy += ["--format", "raw", "-o", str(raw)]
                    # native stacks need the process paused per sample; without, don't pause
                    spy.append("--native" if args.native else "--nonblocking")
                    done = subprocess.run(spy, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"py-spy failed: {done.stdout}{done.stderr}")
                    wrk.wait()
                    counts = fold(raw.read_text().splitlines())
                    if args.keep_raw:
                        args.keep_raw.mkdir(parents=True, exist_ok=True)
                        (args.keep_raw / raw.name).write_bytes(raw.read_bytes())
                    print(
                        f"\n### {mode}, {args.connections} connections: {cpu_us:.0f} µs of CPU "
                        f"per request ({plain.requests} requests, {plain.req_per_s:.0f} req/s, "
                        f"load average {os.getloadavg()[0]:.1f}); "
                        f"{sum(counts.values())} samples\n"
                    )
                    print("| component | samples | share | µs/request |")
                    print("|---|---|---|---|")
                    for name, n, share, us in table(counts, cpu_us):
                        print(f"| {name} | {n} | {share:.1%} | {us:.0f} |")
                    sys.stdout.flush()
                finally:
                    with contextlib.suppress(Exception):
                        proc.stop()
        finally:
            replicas.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
