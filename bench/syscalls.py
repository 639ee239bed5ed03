"""System calls per request of `servegate serve`, counted exactly: `strace -c` on the gateway
under wrk, side by side for several checkouts.

Why: on this machine a system call costs as much as a few µs of Python, and counts, unlike
CPU time, do not move with the machine's load. For each `--compare NAME=SRC` (another
checkout's `src`, on PYTHONPATH) and each mode (JSON, 16-event SSE): two fast backends, the
gateway in front of them (default profile, access log on), a warm-up, then `strace -c -f`
attached to the gateway during a `--duration` s wrk run at `--connections`; the calls of
each kind divided by the requests wrk completed. strace slows the gateway, so the
requests per second it reaches mean nothing; the counts per request do.

    .venv/bin/python bench/syscalls.py --compare base=/work/ref9/src --compare main=src

Loopback only, bounded in time. Benchmark only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dataplane  # noqa: E402  (the same wrk script and prompts as the CPU bench)

ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((dataplane.LOOPBACK, 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer")


def count(
    src: Path, stream: bool, connections: int, duration: float, work: Path
) -> dict[str, float]:
    script = dataplane.wrk_script(work / f"wrk_{stream}.lua", stream)
    backends = [_port(), _port()]
    gateway = _port()
    python = sys.executable
    procs = [
        subprocess.Popen(
            [python, "-m", "servegate.testing.fastbackend", "--port", str(p), "--chunks", "16"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in backends
    ]
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [python, "-m", "servegate.cli", "serve", "--host", dataplane.LOOPBACK]
    command += ["--port", str(gateway)]
    for p in backends:
        command += ["--endpoint", f"http://{dataplane.LOOPBACK}:{p}"]
    gw = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{dataplane.LOOPBACK}:{gateway}"
    out = work / "strace.txt"
    try:
        _wait(url + "/health")
        wrk = ["wrk", "-t1", f"-c{connections}", "-s", str(script), url]
        subprocess.run([*wrk[:2], "-d2s", *wrk[2:]], check=True, capture_output=True)
        tracer = subprocess.Popen(
            ["strace", "-c", "-f", "-p", str(gw.pid), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        ran = subprocess.run(
            [*wrk[:2], f"-d{duration:g}s", *wrk[2:]], check=True, capture_output=True, text=True
        )
        tracer.terminate()
        tracer.wait(timeout=30)
    finally:
        for proc in (gw, *procs):
            proc.terminate()
        for proc in (gw, *procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    requests = int(re.search(r"(\d+) requests in", ran.stdout)[1])  # type: ignore[index]
    calls: dict[str, float] = {}
    for line in out.read_text().splitlines():
        m = ROW.match(line)
        if m and m[2] != "total":
            calls[m[2]] = int(m[1]) / requests
    calls["(total)"] = sum(calls.values())
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="append", required=True, help="NAME=SRC")
    parser.add_argument("--modes", default="json,sse")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args()
    named = [(n, Path(s).resolve()) for n, _, s in (c.partition("=") for c in args.compare)]
    for mode in args.modes.split(","):
        table: dict[str, dict[str, float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name, src in named:
                table[name] = count(src, mode == "sse", args.connections, args.duration, Path(tmp))
        every = {k for calls in table.values() for k in calls if calls[k] >= 0.01}
        kinds = sorted(
            every, key=lambda k: (k == "(total)", -max(t.get(k, 0.0) for t in table.values()))
        )
        print(f"\n### {mode}, {args.connections} connections: system calls per request\n")
        print("| call | " + " | ".join(n for n, _ in named) + " |")
        print("|---|" + "---|" * len(named))
        for kind in kinds:
            cells = " | ".join(f"{table[n].get(kind, 0.0):.3f}" for n, _ in named)
            print(f"| {kind} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
