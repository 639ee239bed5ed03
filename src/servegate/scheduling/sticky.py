"""The default profile's shape, run as one function for a small pool.

The default profile (`config.DEFAULT_PICKER_CONFIG`) is `prefix-cache-affinity-filter`
reading `prefix-cache-scorer`'s match, that scorer, `no-hit-lru-scorer` reading the same
match, load scorers and a picker. Run plugin by plugin, the three readers share the one
match through the cycle's scratch space (`lookup.prefix_scores`): a key and a look-up per
reader, a shared record, then a list comparison or a look-up per endpoint to hand each
reader its part. For a pool of at most `FUSED_LIMIT` candidates on an untimed cycle the
scheduler runs `StickyPath` instead: the match computed once
(`PrefixCacheScorer.match`), the filter's verdict on it (`PrefixCacheAffinityFilter.verdict`),
the survivors' part of it as the prefix scorer's column and handed to
`no-hit-lru-scorer` (`NoHitLRUScorer.given_match`), every other scorer called as it is,
then the profile's generated sum and its picker. The same plugin code on the same inputs,
so the same decision, scores, outcome counters, request cache entries and rng draws
(`tests/unit/test_scheduler_sticky.py` runs both paths side by side).

The match is still left in the cycle's scratch space (`lookup.keep_match`), as the
plugin-by-plugin path leaves it: the latency layer's dispatch reads the picked endpoint's
after the decision (the third `PrefixCacheScorer.score` call per request in a profile).
Only profiles of exactly that shape qualify (`StickyPath.of`); the other scorers must be
ones known to read nothing another plugin leaves in the cycle (`READS_NOTHING_SHARED`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.affinity import NoHitLRUScorer
from servegate.scheduling.affinity_filter import PrefixCacheAffinityFilter
from servegate.scheduling.framework import CycleState, SchedulerProfile
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.lookup import keep_match
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)

READS_NOTHING_SHARED: Final = frozenset(
    {
        ActiveRequestScorer,
        KVCacheUtilizationScorer,
        LoadAwareScorer,
        LoraAffinityScorer,
        PrecisePrefixCacheScorer,
        QueueScorer,
        RunningRequestsSizeScorer,
        TokenLoadScorer,
    }
)
"""Scorer classes that read only the request and the endpoints (not `cycle.data`)."""


class StickyPath:
    """One profile of the default shape: its filter and scorers in one call (the
    scheduler then sums and picks as for any profile)."""

    __slots__ = ("_columns", "_filter", "_prefix")

    def __init__(
        self,
        flt: PrefixCacheAffinityFilter,
        prefix: PrefixCacheScorer,
        columns: Columns,
    ) -> None:
        self._filter = flt
        self._prefix = prefix
        self._columns = columns
        """Every scorer's raw scores of the survivors, given the survivors' match."""

    @classmethod
    def of(cls, profile: SchedulerProfile) -> StickyPath | None:
        """The path for `profile` when it has the default shape (plugins already bound);
        None otherwise."""
        if len(profile.filters) != 1 or type(profile.filters[0]) is not PrefixCacheAffinityFilter:
            return None
        flt = profile.filters[0]
        prefix = flt.prefix
        p = flt.params
        if (
            type(prefix) is not PrefixCacheScorer
            or prefix.producer is not None
            or prefix.params.cold_placement != "none"
            or p.exploration_probability > 0
            or p.affinity_threshold <= 0
        ):
            return None
        terms: list[str] = []
        calls: dict[str, object] = {}
        for i, ws in enumerate(profile.scorers):
            scorer = ws.scorer
            if scorer is prefix:
                terms.append("match")
            elif type(scorer) is NoHitLRUScorer and scorer.prefix is prefix:
                terms.append(f"c{i}(request, endpoints, match)")
                calls[f"c{i}"] = scorer.given_match
            elif type(scorer) in READS_NOTHING_SHARED:
                terms.append(f"c{i}(cycle, request, endpoints)")
                calls[f"c{i}"] = scorer.score
            else:
                return None
        return cls(flt, prefix, _columns(terms, calls))

    def scores(
        self, cycle: CycleState, request: LLMRequest, candidates: list[EndpointState]
    ) -> tuple[list[EndpointState], list[EndpointState], list[Sequence[float]]]:
        """The filter's survivors (a list of this cycle's own), the endpoints it removed
        (last-resort fallbacks) and each scorer's raw scores of the survivors."""
        prefix = self._prefix
        match = prefix.match(request, candidates)
        keep_match(cycle, prefix.name, candidates, match)
        flt = self._filter
        n = len(candidates)
        if n > 1:
            outcome, kept = flt.verdict(request, candidates, match)
        else:
            outcome, kept = "not-applicable", candidates
        counts = flt.decisions
        counts[outcome] = counts.get(outcome, 0) + 1
        if kept is candidates:
            endpoints = list(candidates)  # lists others hold are never handed to plugins
            return endpoints, [], self._columns(cycle, request, endpoints, match)
        spare: list[EndpointState] = []
        if len(kept) < n:
            held = set(kept)  # `EndpointState` hashes by identity
            spare = [s for s in candidates if s not in held]
        if kept != candidates:  # (by identity, in C)
            match = [match[i] for i in map(candidates.index, kept)]  # (a small pool)
        return kept, spare, self._columns(cycle, request, kept, match)


Columns = Callable[
    [CycleState, LLMRequest, list[EndpointState], Sequence[float]], list[Sequence[float]]
]


def _columns(terms: list[str], calls: dict[str, object]) -> Columns:
    """`[term, …]` as one generated function of (cycle, request, endpoints, match), the
    scorers' bound methods as closure variables `c0, c1, …` (the source names only
    generated identifiers)."""
    names = ", ".join(calls)
    source = (
        f"def make({names}):\n"
        "    def columns(cycle, request, endpoints, match):\n"
        f"        return [{', '.join(terms)}]\n"
        "    return columns\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<sticky columns {len(terms)}>", "exec"), namespace)
    made: Columns = namespace["make"](**calls)
    return made
