"""CPU per request of starting a request's coroutine: a new task each time, or one waiting
worker woken by a future (how the lean server serves a keep-alive connection's requests).

On Python 3.11 a task costs a `WeakSet` entry in Python (`asyncio.all_tasks`), a done
callback and its loop turn. Both ways run `--n` empty requests on uvloop and report
`process_time` per request, the minimum over `--repeats`; the worker's figure includes the
driver's own `sleep(0)` per request, so it overstates what waking costs.

    .venv/bin/python bench/task_or_worker.py [--n 100000] [--repeats 5]

Benchmark only.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop


async def _job() -> None:
    return None


async def task_per_request(n: int) -> float:
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    done = 0

    def served(_: asyncio.Task[None]) -> None:
        nonlocal done
        done += 1
        if done == n:
            finished.set_result(None)

    started = time.process_time()
    for _ in range(n):
        loop.create_task(_job()).add_done_callback(served)
    await finished
    return (time.process_time() - started) / n * 1e6


async def worker_per_connection(n: int) -> float:
    loop = asyncio.get_running_loop()
    idle: list[asyncio.Future[int] | None] = [None]
    finished = loop.create_future()

    async def worker() -> None:
        for _ in range(n):
            wake = idle[0] = loop.create_future()
            await wake
        finished.set_result(None)

    running = loop.create_task(worker())
    await asyncio.sleep(0)
    started = time.process_time()
    while not finished.done():
        wake = idle[0]
        if wake is not None and not wake.done():
            wake.set_result(1)
        await asyncio.sleep(0)
    spent = time.process_time() - started
    await running
    return spent / n * 1e6


async def main(n: int, repeats: int) -> None:
    tasks = min([await task_per_request(n) for _ in range(repeats)])
    worker = min([await worker_per_connection(n) for _ in range(repeats)])
    print(f"a task per request:         {tasks:.2f} µs")
    print(f"a worker woken per request: {worker:.2f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    uvloop.run(main(args.n, args.repeats))
