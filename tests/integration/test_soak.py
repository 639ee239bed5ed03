"""Soak: over a thousand concurrent streams through a gateway process, held for a while.

Sizes in `make test`: 1250 closed-loop streaming clients (so that over 1000
are in flight at the gateway, the rest between two requests) for `SERVEGATE_SOAK_S` seconds
(default 20) after a warm-up of one stream per client, through a `servegate
serve` child process to 4 simulator child processes (64 tokens per stream at
speed 1; about 10 s each on a loaded 2-core machine). The full soak is the same
test with `SERVEGATE_SOAK_S=180` (`docs/reliability.md`). Pass: no request
fails (every stream ends with `[DONE]`), the gateway held at least 1000
requests in flight, its RSS (from /proc, sampled every second) is flat under
constant load (the last sample within 5 % + 8 MiB of the first half's
largest), and its open file descriptors return to within 10 of the idle count
once the load's connections are gone (under load they swing by a few hundred:
idle keep-alive connections to the replicas pile up in bursts and expire
after 15 s).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

import aiohttp

from servegate.testing.cluster import SimClusterProcess
from tests.integration.conftest import MODEL, gateway_config, wait_for
from tests.integration.figures import record_figures
from tests.integration.subprocess_gateway import SubprocessGateway, open_fds, rss_kib

CLIENTS = int(os.environ.get("SERVEGATE_SOAK_CLIENTS", "1250"))
SOAK_S = float(os.environ.get("SERVEGATE_SOAK_S", "20"))
WARMUP_MAX_S = 60.0
FD_SETTLE_S = 60.0
"""aiohttp closes idle keep-alive connections 15-30 s after their last use (a 15 s sweep)."""
"""Warm-up lasts until as many streams completed as there are clients (connection pools full)."""
REPLICAS = 4
SIM = {
    "model": MODEL,
    "speed": 1.0,
    "max_num_seqs": 512,
    "num_blocks": 8192,
    "block_size": 16,
    "max_model_len": 2048,
}


class Clients:
    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.n = n
        self.results: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.stop = asyncio.Event()

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"soak client {i}"}],
            "max_tokens": 64,
            "stream": True,
        }
        while not self.stop.is_set():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                async with session.post(self.url + "/v1/chat/completions", json=body) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        self.results[f"status-{resp.status}"] += 1
                    elif raw.rstrip().endswith(b"data: [DONE]"):
                        self.results["ok"] += 1
                    else:
                        self.results["cut"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.results[f"client-{type(exc).__name__}"] += 1
            finally:
                self.in_flight -= 1

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._one(session, i) for i in range(self.n)))


async def gateway_running(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_objective_running_requests{")
    )


async def test_soak_thousand_concurrent_streams() -> None:
    async with SimClusterProcess(REPLICAS, base=SIM) as cluster:
        cfg = gateway_config(cluster.urls, access_log=False)
        cfg["pool"]["health"] = {"interval_s": 0.5, "timeout_s": 5.0, "failure_threshold": 5}
        cfg["pool"]["scrape_interval_s"] = 0.2
        async with SubprocessGateway(cfg, ready_endpoints=REPLICAS) as gw:
            pid = gw.pid
            idle = (open_fds(pid), rss_kib(pid))
            clients = Clients(gw.url, CLIENTS)
            timeout = aiohttp.ClientTimeout(total=120)
            async with (
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), timeout=timeout
                ) as load,
                aiohttp.ClientSession() as probe,
            ):
                runner = asyncio.create_task(clients.run(load))
                await wait_for(
                    lambda: sum(clients.results.values()) >= CLIENTS, WARMUP_MAX_S, "warm-up"
                )
                started = time.monotonic()
                held: list[float] = []
                done_before = sum(clients.results.values())
                samples: list[tuple[int, int]] = []
                while time.monotonic() - started < SOAK_S:
                    samples.append((open_fds(pid), rss_kib(pid)))
                    await asyncio.sleep(min(1.0, SOAK_S))
                    held.append(await gateway_running(probe, gw.url))
                samples.append((open_fds(pid), rss_kib(pid)))
                clients.stop.set()
                await asyncio.wait_for(runner, 150.0)
            # the load's connections are closed; the gateway's idle upstream ones expire
            settle_from = time.monotonic()
            await wait_for(lambda: open_fds(pid) <= idle[0] + 10, FD_SETTLE_S, "fds back to idle")
            settled_s = time.monotonic() - settle_from
            after = (open_fds(pid), rss_kib(pid))
            sent = sum(clients.results.values())
            failures = sent - clients.results["ok"]
    half = len(samples) // 2
    first, second = samples[:half], samples[half:]
    figures: dict[str, Any] = {
        "clients": CLIENTS,
        "soak_s": SOAK_S,
        "requests_completed": sent,
        "requests_in_soak_window": sent - done_before,
        "failures": failures,
        "results": dict(clients.results),
        "held_in_flight_at_gateway_max": max(held),
        "held_in_flight_at_gateway_min": min(held),
        "client_in_flight_max": clients.max_in_flight,
        "fds_idle": idle[0],
        "fds_first_half_max": max(f for f, _ in first),
        "fds_second_half_max": max(f for f, _ in second),
        "fds_after": after[0],
        "fds_settle_s": round(settled_s, 1),
        "rss_kib_idle": idle[1],
        "rss_kib_first_half_max": max(r for _, r in first),
        "rss_kib_second_half_max": max(r for _, r in second),
        "rss_kib_end_of_load": samples[-1][1],
        "rss_kib_after": after[1],
    }
    record_figures("soak", figures)
    assert failures == 0, figures
    assert max(held) >= 1000 or CLIENTS < 1250, figures
    assert after[0] <= idle[0] + 10, figures
    assert figures["rss_kib_end_of_load"] <= figures["rss_kib_first_half_max"] * 1.05 + 8 * 1024, (
        figures
    )
