"""Screenshot of the gateway's status page (`/ui`) under traffic, for docs/img.

    .venv/bin/python scripts/ui_screenshot.py docs/img/status-page.png

Starts the demo's cluster (4 simulated replicas, small prefix caches, the first with
LoRA adapters) and a gateway with servegate's default picker fed by KV events, sends
the demo's shared-prefix traffic plus a few LoRA requests, and photographs the page
in headless Chromium (`make chromium`) while the traffic runs.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp

from servegate.bench.client import send_request
from servegate.bench.workloads import Api, BenchRequest
from servegate.demo import MODEL, DemoSpec
from servegate.testing.browser import HeadlessChromium
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner


async def main(target: Path) -> None:
    spec = DemoSpec(port=0)
    lora = {"lora": {"max_loras": 2, "adapters": ["sql-lora", "chat-lora"]}}
    overrides = [lora] + [{}] * (spec.replicas - 1)
    async with SimCluster(
        spec.replicas, base=spec.sim_config(), overrides=overrides, kv_events="tcp"
    ) as cluster:
        events = [s.kv_events_endpoint for s in cluster.servers]
        async with (
            GatewayRunner(spec.gateway_config(cluster.urls, events, None)) as gw,
            aiohttp.ClientSession() as session,
            HeadlessChromium() as browser,
        ):
            for _ in range(200):
                if gw.gateway.pool.ready_count() == spec.replicas:
                    break
                await asyncio.sleep(0.1)
            requests = spec.workload.generate(model=MODEL, api=Api.COMPLETIONS, seed=0)
            stop = asyncio.Event()

            async def worker(offset: int) -> None:
                index = offset
                while not stop.is_set():
                    request = requests[index % len(requests)]
                    if index % 17 == 0:
                        request = BenchRequest("sql-lora", 16, prompt="SELECT a LoRA answer")
                    await send_request(session, gw.url, request, stream=True)
                    index += spec.concurrency

            workers = [asyncio.create_task(worker(i)) for i in range(spec.concurrency)]
            page = await browser.page()
            await page.navigate(gw.url + "/ui")
            await asyncio.sleep(8.0)
            await page.wait_for("Number(document.body.dataset.polls || 0)", lambda n: n > 3)
            await page.evaluate("document.querySelector('tr.decision details').open = true")
            await asyncio.sleep(0.2)
            png = await page.screenshot(width=1400, height=900)
            await asyncio.to_thread(target.write_bytes, png)
            stop.set()
            await asyncio.gather(*workers)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
