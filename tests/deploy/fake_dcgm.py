"""A DCGM-exporter stand-in: no GPU here, so the gauges come from the simulators' load.

It speaks what NVIDIA's dcgm-exporter serves on :9400/metrics in Kubernetes mode —
the same family names, HELP/TYPE lines and labels (gpu, UUID, pci_bus_id, device,
modelName, Hostname, DCGM_FI_DRIVER_VERSION, container, namespace, pod) — so the
dashboard's and the adapter's PromQL run against the shape they will meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

FAMILIES = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
)
FB_TOTAL_MIB = 81559


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    pod: str
    namespace: str
    container: str
    utilization: Callable[[], float]
    """Percent busy, read at every scrape."""


class FakeDcgmExporter:
    def __init__(self, gpus: list[Gpu], hostname: str = "gpu-node-1") -> None:
        self.gpus = gpus
        self.hostname = hostname
        self.scrapes = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    def render(self) -> str:
        lines: list[str] = []
        values = {gpu.index: max(0.0, min(100.0, gpu.utilization())) for gpu in self.gpus}
        for family, help_text in FAMILIES:
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} gauge")
            for gpu in self.gpus:
                util = values[gpu.index]
                used = round(FB_TOTAL_MIB * (0.55 + 0.004 * util))
                value = {
                    "DCGM_FI_DEV_GPU_UTIL": round(util),
                    "DCGM_FI_DEV_FB_USED": used,
                    "DCGM_FI_DEV_FB_FREE": FB_TOTAL_MIB - used,
                    "DCGM_FI_DEV_POWER_USAGE": round(90.0 + 6.1 * util, 3),
                }[family]
                labels = (
                    f'gpu="{gpu.index}",UUID="GPU-5f3c2a1e-0000-4000-8000-00000000000{gpu.index}",'
                    f'pci_bus_id="00000000:{gpu.index + 7:02X}:00.0",device="nvidia{gpu.index}",'
                    f'modelName="NVIDIA H100 80GB HBM3",Hostname="{self.hostname}",'
                    f'DCGM_FI_DRIVER_VERSION="550.54.15",container="{gpu.container}",'
                    f'namespace="{gpu.namespace}",pod="{gpu.pod}"'
                )
                lines.append(f"{family}{{{labels}}} {value}")
        return "\n".join(lines) + "\n"

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=self.render(), content_type="text/plain", charset="utf-8")

    async def __aenter__(self) -> FakeDcgmExporter:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
