"""Capacity of one simulator process: many concurrent streams, event-loop lag, memory.

    .venv/bin/python bench/bench_simulator_capacity.py [--streams 500] [--soak-s 60]

Starts one `python -m servegate.simulator` child (real-time costs, speed 1), then
keeps `--streams` streaming chat requests open at once from this process (each
client loops: a new request as soon as its previous one ends, output lengths vary
so the streams do not finish together) for a warm-up and a bounded soak. It
reports, from inside the simulator (`/admin/loop_lag`): the event-loop lag
median / p99 / max during the soak and the simulator's RSS after start, after the
warm-up and after the soak; from `/proc`: the simulator's CPU use during the
soak; from the client: requests, tokens (SSE chunks) per second, TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

import aiohttp

from servegate.testing.cluster import SimClusterProcess

MIB = 1024 * 1024


async def stream_once(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[int, float]:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    started = time.monotonic()
    first = 0.0
    chunks = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if not first:
                    first = time.monotonic() - started
    return chunks, first


async def worker(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    deadline: float,
    max_tokens: int,
    counts: dict[str, Any],
) -> None:
    rng = random.Random(index)
    prompt = f"user {index} asks: please summarize the following document about the cache " * 8
    await asyncio.sleep(rng.random())
    while time.monotonic() < deadline:
        chunks, ttft = await stream_once(
            session, url, prompt, rng.randint(max_tokens // 4, max_tokens)
        )
        counts["requests"] += 1
        counts["chunks"] += chunks
        counts["ttft"].append(ttft)


async def wave(url: str, streams: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    counts: dict[str, Any] = {"requests": 0, "chunks": 0, "ttft": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        deadline = time.monotonic() + seconds
        peak_running = 0
        tasks = [
            asyncio.create_task(worker(session, url, i, deadline, max_tokens, counts))
            for i in range(streams)
        ]
        started = time.monotonic()
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
            async with session.get(url + "/admin/state") as resp:
                peak_running = max(peak_running, (await resp.json())["running"])
        await asyncio.gather(*tasks)
        counts["elapsed"] = time.monotonic() - started
        counts["peak_running"] = peak_running
    return counts


async def lag(url: str, reset: bool = False) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        method = session.post if reset else session.get
        async with method(url + "/admin/loop_lag") as resp:
            data: dict[str, Any] = await resp.json()
            return data


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(args: argparse.Namespace) -> None:
    base = {
        "model": "sim-model",
        "num_blocks": args.num_blocks,
        "block_size": 16,
        "max_model_len": 4096,
        "max_num_seqs": args.streams + 16,
        "max_num_batched_tokens": 8192,
        "speed": 1.0,
    }
    async with SimClusterProcess(1, base=base) as cluster:
        url = cluster.urls[0]
        rss_start = (await lag(url, reset=True))["rss_bytes"]
        warm = await wave(url, args.streams, args.warmup_s, args.max_tokens)
        rss_warm = (await lag(url, reset=True))["rss_bytes"]
        cpu_before = cpu_seconds(cluster[0].pid)
        soak = await wave(url, args.streams, args.soak_s, args.max_tokens)
        cpu = (cpu_seconds(cluster[0].pid) - cpu_before) / soak["elapsed"]
        during = await lag(url)
        rss_end = during["rss_bytes"]
    print(
        f"simulator capacity: {args.streams} concurrent streams, max_tokens {args.max_tokens}, speed 1"
    )
    print(
        f"  warm-up {args.warmup_s:.0f} s: {warm['requests']} requests, peak running {warm['peak_running']}"
    )
    print(
        f"  soak {soak['elapsed']:.0f} s: {soak['requests']} requests, {soak['chunks']} chunks "
        f"({soak['chunks'] / soak['elapsed']:.0f} tokens/s), peak running {soak['peak_running']}, "
        f"TTFT median {statistics.median(soak['ttft']) * 1000:.0f} ms"
    )
    print(f"  simulator CPU during soak: {cpu * 100:.0f} % of one core")
    print(
        f"  event-loop lag during soak ({during['samples']} samples, 50 ms timer): "
        f"median {during['median_ms']:.2f} ms, p99 {during['p99_ms']:.2f} ms, "
        f"max {during['max_ms']:.2f} ms (process CPU in that interval "
        f"{during['max_lag_cpu_ms']:.1f} ms); {during['gc_collections']} GC runs, "
        f"longest {during['gc_max_ms']:.1f} ms"
    )
    print(
        f"  simulator RSS: start {rss_start / MIB:.1f} MiB, after warm-up {rss_warm / MIB:.1f} MiB, "
        f"after soak {rss_end / MIB:.1f} MiB (soak growth {(rss_end - rss_warm) / MIB:+.1f} MiB)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--soak-s", type=float, default=60.0)
    parser.add_argument("--num-blocks", type=int, default=20000)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
