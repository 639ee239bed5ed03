"""Own time per request of one slice's functions in the socket-free request path, under cProfile.

    .venv/bin/python bench/request_path_slice.py [--stream] [--requests N] [--top K]
    PYTHONPATH=/other/src .venv/bin/python bench/request_path_slice.py   # another checkout

Runs `request_path_cpu.measure` (the default profile, two endpoints, a ~1.5 kB
completion) under cProfile and sums the own time (`tottime`) of the functions defined
in the slice's files (`--files`, path fragments; by default the Director, flow control
and the bookkeeping: context, lease, parse, admission, metrics, histogram, access log)
that run at least once per request, less `--exclude` (by default the two
`GatewayMetrics` methods routing owns). cProfile adds a fixed cost to every call, so
its microseconds are larger than the real ones and a change that saves calls shows
more than it saves: compare two checkouts with it, and quote `request_path_cpu.py` for
the real cost. Benchmark only.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import request_path_cpu

SLICE = (
    "control/director.py", "control/lease.py", "control/context.py", "gateway/inference.py",
    "gateway/admission.py", "flowcontrol/", "gateway/metrics.py", "gateway/histogram.py",
    "gateway/access_log.py", "gateway/parse.py",
)  # fmt: skip
NOT_SLICE = ("observe_pick", "scheduled", "_score_child")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--files", nargs="*", default=list(SLICE))
    parser.add_argument("--exclude", nargs="*", default=list(NOT_SLICE))
    args = parser.parse_args()
    profile = cProfile.Profile()

    async def run() -> None:
        profile.enable()
        await request_path_cpu.measure(args.requests, 1, args.stream)
        profile.disable()

    with asyncio.Runner(loop_factory=request_path_cpu.loop_factory()) as runner:
        runner.run(run())
    requests = args.requests + 2000  # measure's warm-up runs under the profile too
    rows = []
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    for (path, _, name), (_, calls, own, _, _) in stats.items():
        if (
            any(part in path for part in args.files)
            and calls >= 0.9 * requests
            and name not in args.exclude
        ):
            rows.append(
                (own * 1e6 / requests, calls / requests, path.split("servegate/")[-1], name)
            )
    rows.sort(reverse=True)
    for us, per, path, name in rows[: args.top]:
        print(f"{us:6.2f} µs  {per:4.1f}/req  {path}:{name}")
    total = sum(r[0] for r in rows)
    print(f"slice own time under cProfile: {total:.2f} µs per request ({len(rows)} functions)")


if __name__ == "__main__":
    main()
