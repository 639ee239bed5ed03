"""A real headless Chromium driven over the DevTools protocol (CDP), for page tests.

    async with HeadlessChromium() as browser:
        page = await browser.page()
        await page.navigate("http://127.0.0.1:8080/ui")
        rows = await page.wait_for("document.querySelectorAll('tr').length", lambda n: n > 2)
        png = await page.screenshot()

Debian's `chromium` package (`make chromium` installs it); no browser download, no
Playwright. The browser listens for DevTools on a port it picks itself and writes it
to `DevToolsActivePort` in a fresh profile directory; we speak CDP's JSON messages over
aiohttp's WebSocket client to the first page target. Everything stays on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
)


class BrowserError(RuntimeError):
    pass


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class Page:
    """One page target's CDP session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        """Console messages and uncaught exceptions the page reported."""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = orjson.loads(message.data)
            future = self._pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
                continue
            method = data.get("method")
            if method == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("type"))) for a in args))
            elif method == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.console.append("exception: " + str(details.get("exception", details)))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(BrowserError("the DevTools connection closed"))

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        message = {"id": ident, "method": method, "params": params or {}}
        await self._ws.send_str(orjson.dumps(message).decode())  # CDP wants text frames
        reply = await asyncio.wait_for(future, 30.0)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def navigate(self, url: str) -> None:
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"navigating to {url}: {result['errorText']}")

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(
        self,
        expression: str,
        predicate: Callable[[Any], bool] = bool,
        timeout: float = 15.0,
    ) -> Any:
        """Evaluates `expression` until `predicate(value)` holds; returns that value."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(BrowserError):
                value = await self.evaluate(expression)
                if predicate(value):
                    return value
            await asyncio.sleep(0.1)
        raise AssertionError(
            f"timed out waiting for {expression!r} (last value {value!r}; console {self.console})"
        )

    async def screenshot(
        self, width: int = 1280, height: int = 900, full_page: bool = True
    ) -> bytes:
        if full_page:
            height = max(
                height, int(await self.evaluate("document.documentElement.scrollHeight") or 0)
            )
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        result = await self.send("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class HeadlessChromium:
    def __init__(self, executable: str | None = None, start_timeout_s: float = 30.0) -> None:
        self.executable = executable or chromium_path()
        self.start_timeout_s = start_timeout_s
        self._profile: str | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pages: list[Page] = []
        self.port = 0

    async def __aenter__(self) -> HeadlessChromium:
        if self.executable is None:
            raise BrowserError("chromium is not installed (make chromium)")
        self._profile = tempfile.mkdtemp(prefix="sg-chromium-")
        self._process = await asyncio.create_subprocess_exec(
            self.executable,
            *FLAGS,
            f"--user-data-dir={self._profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._session = aiohttp.ClientSession()
        try:
            self.port = await self._wait_port()
        except BaseException:
            await self.close()
            raise
        return self

    async def _wait_port(self) -> int:
        assert self._profile is not None and self._process is not None
        marker = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.returncode is not None:
                raise BrowserError(f"chromium exited with {self._process.returncode}")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(marker.read_text().splitlines()[0])
            await asyncio.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port in {self.start_timeout_s} s")

    async def page(self) -> Page:
        """The browser's first page target (about:blank), with Page and Runtime enabled."""
        assert self._session is not None
        deadline = time.monotonic() + self.start_timeout_s
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            async with self._session.get(f"http://127.0.0.1:{self.port}/json/list") as resp:
                targets = [t for t in await resp.json() if t.get("type") == "page"]
            if targets:
                break
            await asyncio.sleep(0.05)
        if not targets:
            raise BrowserError("chromium has no page target")
        ws = await self._session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        self._pages.append(page)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        return page

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for page in self._pages:
            await page.close()
        self._pages = []
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._process is not None:
            if self._process.returncode is None:
                self._process.terminate()
                try:
                    await asyncio.wait_for(self._process.wait(), 10.0)
                except TimeoutError:
                    self._process.kill()
                    await self._process.wait()
            self._process = None
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None
