"""Cache-aware routing on real vLLM, judged by the engines' own prefix-cache counters.

A smaller run of `bench/bench_real_cache_routing.py` (same cluster settings, same
prefix sizes: 8 groups × 26 blocks = 208 blocks, more than one server's 127, less
than the cluster's 254; fewer requests). Round-robin spreads every group over both
servers, so each server cycles 8 prefixes through room for ~4; the default profile
must keep each group on one server like the oracle (group g → server g mod 2) does,
with nothing configured (`zero-config`: only the endpoint URLs; the routing
tokenizer is found through `/v1/models`) and with the HF tokenizer and KV events
configured (`default`).

Measured with the default since 2026-12-02 (sticky until saturated, cold prefixes by
`no-hit-lru-scorer`; `bench_real_cache_routing.py --requests 40 --seeds 0 1 2`,
session 5): round-robin 39.8 / 56.0 / 46.5 %, zero-config 75.1 / 75.7 / 74.7 % (100 %
of the oracle's 75.1 / 75.7 / 74.7 % on every seed), configured default 72.9 / 75.7 /
74.7 % (97 / 100 / 100 %). The previous default lost up to 7 % of the oracle where a
cold group landed (random tie-break between idle servers: a 5/3 split of the 8 groups
overfills one server, 5 × 26 = 130 blocks > 127); the least-recently-given placement
removed that. Hence the bounds: zero-config ≥ round-robin + 25 points and ≥ 95 % of the
oracle (issue 16's target); the configured default ≥ round-robin + 25 points.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from servegate.testing.tinymodel import TinyModel
from servegate.testing.vllm_cluster import VllmCluster


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_real_cache_routing.py"
    spec = importlib.util.spec_from_file_location("bench_real_cache_routing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

REQUESTS = 40
MARGIN = 0.25
"""Hit-rate points the defaults must gain over round-robin (measured at seed 0: 29.9–35.3)."""
OF_ORACLE = 0.95
"""Share of the oracle's hit rate the zero-config default must reach (measured: 100 % on
seeds 0, 1 and 2); issue 16's target for shared-prefix traffic with nothing configured."""


def test_default_profile_beats_round_robin_and_nears_the_oracle(
    cluster: VllmCluster, tiny_model: TinyModel, tmp_path: Path
) -> None:
    spec = bench.Spec(requests=REQUESTS)
    results = asyncio.run(bench.run_all(cluster, tiny_model, spec, tmp_path))
    print("\n" + bench.table(results))
    by_policy = {r.policy: r for r in results}
    assert all(r.errors == 0 for r in results), bench.table(results)
    assert all(sum(r.per_server) == REQUESTS for r in results), bench.table(results)
    rr, zero, default, oracle = (
        by_policy[p].hit_rate for p in ("round-robin", "zero-config", "default", "oracle")
    )
    assert zero >= rr + MARGIN, bench.table(results)
    assert zero >= OF_ORACLE * oracle, bench.table(results)
    assert default >= rr + MARGIN, bench.table(results)


@pytest.mark.parametrize(
    ("groups", "requests"),
    [(8, 40), (3, 10)],
    ids=["standard", "few-groups"],
)
def test_workload_shares_one_prefix_per_group(groups: int, requests: int) -> None:
    items = bench.workload(bench.Spec(groups=groups, requests=requests))
    assert len(items) == requests
    first: dict[int, str] = {}
    for item in items:
        prefix = first.setdefault(item.group, item.prompt)
        cut = prefix.index(" question ")
        assert item.prompt[:cut] == prefix[:cut]
    assert len({p[: p.index(" question ")] for p in first.values()}) == len(first)
