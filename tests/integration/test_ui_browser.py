"""The status page in a real headless Chromium (Debian's package; `make test` installs it
with `make chromium`): it loads, lists a simulated cluster's endpoints, and updates.

The admin key is set, so the page and its polls must carry it (sent by the browser as
an extra header, as a browser would after the basic-auth prompt).
"""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import aiohttp
import pytest

from servegate.testing.browser import HeadlessChromium, chromium_path
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, MODEL, gateway_config, wait_ready

ADMIN_KEY = "browser-admin-key"
ROWS = "[...document.querySelectorAll('table.endpoints tbody tr')].map(r => r.dataset.address)"
ROUTED = "document.querySelector('#tile-routed .v')?.textContent"
POLLS = "Number(document.body.dataset.polls || 0)"
DECISIONS = "document.querySelectorAll('tr.decision').length"


def _chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.fail(
            "`chromium` is not installed: `make test` installs Debian's chromium package "
            "(make chromium, or apt-get install chromium)"
        )
    return path


async def _send(session: aiohttp.ClientSession, url: str, n: int, offset: int) -> None:
    for i in range(n):
        body = {"model": MODEL, "prompt": f"status page {offset + i}", "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()


async def test_status_page_loads_lists_endpoints_and_updates() -> None:
    executable = _chromium()
    lora = {"lora": {"max_loras": 2, "adapters": ["sql-lora"]}}
    async with (
        SimCluster(3, base=FAST_SIM, overrides=[lora, {}, {}]) as cluster,
        GatewayRunner(gateway_config(cluster.urls, admin_keys=[ADMIN_KEY])) as gw,
        aiohttp.ClientSession() as session,
        HeadlessChromium(executable) as browser,
    ):
        await wait_ready(gw, 3)
        await _send(session, gw.url, 4, 0)
        page = await browser.page()
        basic = base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()
        await page.send("Network.enable")
        await page.send(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {basic}"}}
        )
        await page.navigate(gw.url + "/ui?interval=250")
        rows = await page.wait_for(ROWS, lambda v: v is not None and len(v) == 3)
        assert sorted(rows) == sorted(cluster.addresses)
        text = await page.evaluate("document.body.innerText")
        for address in cluster.addresses:
            assert address in text
        assert await page.evaluate(ROUTED) == "4"
        assert await page.wait_for(DECISIONS, lambda n: n == 4) == 4
        # a decision's score table, once opened, stays open across updates
        await page.evaluate("document.querySelector('tr.decision details').open = true")
        await asyncio.sleep(0.05)
        opened = await page.evaluate("document.querySelector('tr.decision details').dataset.seq")
        polls = await page.evaluate(POLLS)
        # it updates: new traffic shows up without a reload
        await _send(session, gw.url, 3, 100)
        await page.wait_for(ROUTED, lambda v: v == "7")
        assert await page.evaluate(POLLS) > polls
        assert await page.evaluate(DECISIONS) == 7
        still_open = f"document.querySelector('details[data-seq=\"{opened}\"]').open"
        assert await page.evaluate(still_open) is True
        cells = "document.querySelector('details[open] table.scores').rows.length"
        assert await page.evaluate(cells) == 4  # a header and the 3 ranked candidates
        assert "update failed" not in await page.evaluate("document.body.innerText")
        assert not [line for line in page.console if line.startswith("exception")]
        shot = os.environ.get("SERVEGATE_UI_SCREENSHOT")
        if shot:
            await asyncio.sleep(0.6)
            png = await page.screenshot()
            await asyncio.to_thread(Path(shot).write_bytes, png)
