"""The shipped picker for several routers loads, and differs from the default only where
docs/scaleout.md says: hashed cold placement (so no `no-hit-lru-scorer`, whose memory is
per router), and no in-flight signals (the in-flight scorer, and the affinity filter
whose saturation gate reads in-flight counts)."""

from __future__ import annotations

from pathlib import Path

from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.prefix.approx import PrefixCacheScorer

PICKER = Path(__file__).parents[2] / "deploy" / "pickers" / "multi-router.yaml"


def test_multi_router_picker_is_the_default_minus_in_flight_plus_hash() -> None:
    ctx = PluginContext(staleness_s=2.0)
    multi = load_picker_config(PICKER.read_text(), ctx)
    default = load_picker_config(DEFAULT_PICKER_CONFIG, ctx)
    assert set(default.plugins) - set(multi.plugins) == {
        "active-request-scorer",
        "no-hit-lru-scorer",
        "prefix-cache-affinity-filter",
    }
    assert set(multi.plugins) <= set(default.plugins)
    prefix = multi.plugins["prefix-cache-scorer"]
    assert isinstance(prefix, PrefixCacheScorer)
    assert prefix.params.cold_placement == "hash"
