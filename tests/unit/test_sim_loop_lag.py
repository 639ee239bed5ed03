"""The loop-lag monitor behind `/admin/loop_lag`."""

from __future__ import annotations

import asyncio
import gc

from servegate.simulator.loop_lag import LoopLagMonitor, rss_bytes


async def test_samples_gc_and_reset() -> None:
    monitor = LoopLagMonitor(interval_s=0.001)
    monitor.start()
    try:
        for _ in range(1000):
            if len(monitor.samples) >= 3:
                break
            await asyncio.sleep(0.005)
        gc.collect()
        summary = monitor.summary()
        assert summary["samples"] >= 3
        assert summary["gc_collections"] >= 1
        assert 0 <= summary["median_ms"] <= summary["p99_ms"] <= summary["max_ms"]
        monitor.reset()
        assert monitor.summary()["samples"] == 0
    finally:
        await monitor.stop()
    assert monitor._on_gc not in gc.callbacks


def test_rss_is_positive() -> None:
    assert rss_bytes() > 0
