"""The scheduler: runs the profile handler's profiles and returns a Decision.

Per profile: filters in order, then every scorer; each score is clamped to
[0, 1] (NaN → 0) and multiplied by the scorer's weight; the weighted columns
are summed and the picker ranks the endpoints. `schedule` is pure: no I/O, no
clock reads for decisions (time is `cycle.now`, randomness `cycle.rng`).
`time.perf_counter_ns` is read only to account time per plugin in `stats`, on one
cycle (and one hook call) in `timing_every`: each timed call counts for `timing_every`
calls in `PluginTiming`, so the exported histograms estimate every call's duration
without a clock read and a bucket update per plugin per request.

A pool larger than `exhaustive_limit` is scored on a shortlist, so one decision
costs the same at 1,000 endpoints as at 100: the endpoints each `Shortlister`
scorer names (the replicas holding the prompt's longest cached prefixes) plus a
uniform sample of `sample_size` others, drawn with `cycle.rng`. Prefix decisions
stay those of exhaustive scoring; a load-only decision picks the best of a random
sample ("power of d choices" with d = `sample_size`), which balances nearly as well
as the global best (`tests/unit/test_scheduler_shortlist.py` compares the two).

Per-endpoint breakdowns are kept column-wise; `ProfileResult.scores` and
`.totals` are lazy read-only views that build a row only when someone reads
it (debug headers, logs), so the hot path allocates no per-endpoint dicts.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse
from math import gcd
from time import perf_counter_ns
from typing import Any, Protocol

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.framework import (
    IDENTITY_ONLY,
    KEEPS_FALLBACKS,
    RECORDS_DECISIONS,
    CycleState,
    Decision,
    Filter,
    NoCandidates,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    ProfileResult,
    ResponseComplete,
    SchedulerProfile,
    Scorer,
    Shortlister,
)
from servegate.scheduling.profiles import (
    HeaderProfileHandler,
    ProfileSetCheck,
    SingleProfileHandler,
)
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.sticky import StickyPath

PLUGIN_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
"""Upper bounds of the per-call duration buckets (llm-d's plugin-duration buckets)."""
_BOUNDS_NS = tuple(round(b * 1e9) for b in PLUGIN_BUCKETS_S)

FILTER = "Filter"
SCORER = "Scorer"
PICKER = "Picker"
PROFILE_PICKER = "ProfilePicker"
PROCESS_RESULTS = "ProcessProfilesResults"
PRE_REQUEST = "PreRequest"
RESPONSE_COMPLETE = "ResponseComplete"
"""Extension point names, as llm-d labels `plugin_duration_seconds`."""


TIMING_EVERY = 16
"""The scheduler times one cycle (and one hook call) in this many; see `PluginTiming`."""


@dataclass(slots=True)
class PluginTiming:
    """Time spent in one plugin at one extension point, for the gateway's exporter.

    The scheduler times a sample of the calls (one cycle in `Scheduler.timing_every`),
    each counting for `weight` calls, so `calls`, `total_ns` and `counts` estimate every
    call's; they grow in steps of the weight.
    """

    type: str = ""
    """The plugin's type, e.g. `prefix-cache-scorer`."""
    calls: int = 0
    """How many times the plugin ran (estimated: each timed call counts for its weight)."""
    total_ns: int = 0
    """Cumulative wall time inside the plugin, in nanoseconds (estimated likewise)."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(_BOUNDS_NS) + 1))
    """Calls per duration bucket (`PLUGIN_BUCKETS_S`, then +Inf); not cumulative."""

    def add(self, ns: int, weight: int = 1) -> None:
        """One timed call of `ns` nanoseconds, standing for `weight` calls."""
        self.calls += weight
        self.total_ns += ns * weight
        self.counts[bisect_left(_BOUNDS_NS, ns)] += weight


@dataclass(slots=True)
class SchedulerStats:
    """Counters the scheduler keeps; exporters read them, nothing resets them."""

    cycles: int = 0
    """Calls to `schedule`."""
    no_candidates: int = 0
    """Cycles that ended with `NoCandidates`."""
    shortlisted: int = 0
    """Profile runs scored on a shortlist instead of every candidate (large pools)."""
    plugins: dict[tuple[str, str], PluginTiming] = field(default_factory=dict)
    """Per (extension point, plugin name): time in filter/score/pick/profile-handler calls."""
    hooks: dict[tuple[str, str], PluginTiming] = field(default_factory=dict)
    """Per (extension point, plugin name): time in `pre_request` / `response_complete`."""


def clamp(x: float) -> float:
    """`x` limited to [0, 1]; NaN → 0."""
    return 1.0 if x >= 1.0 else (x if x > 0.0 else 0.0)


# Tested with `type(x) is`, never `isinstance`: compiled by mypyc (native.txt), this class
# and TotalsView share Mapping's ABC registry, which holds dict.
class ScoreTable(Mapping[str, Mapping[str, float]]):
    """`table[address][scorer name]` → weighted score, built row by row on demand.

    Holds each scorer's raw output and weight; clamping and weighting happen
    when a row is read, exactly as they did for the totals.
    """

    __slots__ = ("_endpoints", "_index", "_names", "_observe", "_raw", "_row", "_weights")

    def __init__(
        self,
        endpoints: list[EndpointState],
        names: list[str],
        weights: list[float],
        raw: list[Sequence[float]],
        row: Row | None = None,
        observe: Observe | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._names = names
        self._weights = weights
        self._raw = raw
        self._row = row
        """`fused_row(weights)`, when the profile built one: `weighted_row` written out."""
        self._observe = observe
        """`fused_observe(weights)`, when the profile built one: `observe_row` written out."""
        self._index: dict[str, int] | None = None

    def _position(self, address: str) -> int:
        if self._index is None:
            self._index = {s.endpoint.address: i for i, s in enumerate(self._endpoints)}
        return self._index[address]

    def __getitem__(self, address: str) -> dict[str, float]:
        i = self._position(address)
        return {
            name: w * clamp(column[i])
            for name, w, column in zip(self._names, self._weights, self._raw, strict=True)
        }

    def __iter__(self) -> Iterator[str]:
        return (s.endpoint.address for s in self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)

    @property
    def names(self) -> list[str]:
        """The scorers' names, in the profile's order (the same list for every cycle of a
        profile: callers may key on its identity while they hold it)."""
        return self._names

    @property
    def scored(self) -> list[EndpointState]:
        """The endpoints scored, in the table's order (read-only)."""
        return self._endpoints

    def weighted_row(self, state: EndpointState) -> list[float] | None:
        """`state`'s weighted scores in `names` order, as `self[address]` gives them, without
        an address index or a dict; None when `state` was not scored."""
        try:
            i = self._endpoints.index(state)  # by identity, in C
        except ValueError:
            return None
        if self._row is not None:
            return self._row(self._raw, i)
        return [
            w if (x := column[i]) >= 1.0 else (w * x if x > 0.0 else 0.0)
            for w, column in zip(self._weights, self._raw, strict=True)
        ]

    def observe_row(self, state: EndpointState, children: Sequence[Bins]) -> bool:
        """Add `state`'s weighted scores (`weighted_row`'s values) to `children`, one
        histogram child per scorer in `names` order: a count in the bucket whose bound is
        the first at or above the value (`bisect_left`), and the value to the sum. False
        (nothing added) when `state` was not scored or no scorer ran."""
        try:
            i = self._endpoints.index(state)  # by identity, in C
        except ValueError:
            return False
        if not self._raw:
            return False
        if self._observe is not None:
            self._observe(self._raw, i, children)
            return True
        values = self.weighted_row(state) or []
        for child, value in zip(children, values, strict=True):
            child.counts[bisect_left(child.bounds, value)] += 1
            child.sum += value
        return True

    def to_dict(self) -> dict[str, dict[str, float]]:
        names = self._names
        columns = [
            [w if x >= 1.0 else (w * x if x > 0.0 else 0.0) for x in raw]
            for w, raw in zip(self._weights, self._raw, strict=True)
        ]
        if not columns:
            return {s.endpoint.address: {} for s in self._endpoints}
        rows = zip(*columns, strict=True)
        return {
            s.endpoint.address: dict(zip(names, row, strict=True))
            for s, row in zip(self._endpoints, rows, strict=True)
        }

    def __repr__(self) -> str:
        return f"ScoreTable({self.to_dict()!r})"


class TotalsView(Mapping[str, float]):
    """`totals[address]` → summed weighted score, looked up on demand."""

    __slots__ = ("_endpoints", "_index", "_totals")

    def __init__(self, endpoints: list[EndpointState], totals: list[float]) -> None:
        self._endpoints = endpoints
        self._totals = totals
        self._index: dict[str, int] | None = None

    def __getitem__(self, address: str) -> float:
        if self._index is None:
            self._index = {s.endpoint.address: i for i, s in enumerate(self._endpoints)}
        return self._totals[self._index[address]]

    def __iter__(self) -> Iterator[str]:
        return (s.endpoint.address for s in self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)

    def to_dict(self) -> dict[str, float]:
        return {s.endpoint.address: t for s, t in zip(self._endpoints, self._totals, strict=True)}

    def __repr__(self) -> str:
        return f"TotalsView({self.to_dict()!r})"


def result_as_dict(result: ProfileResult) -> dict[str, Any]:
    """A JSON-ready copy of one profile's result: ranking, totals and per-scorer scores."""
    scores, totals = result.scores, result.totals
    return {
        "ranked": [s.endpoint.address for s in result.ranked],
        "totals": totals.to_dict() if type(totals) is TotalsView else dict(totals),
        "scores": (
            scores.to_dict()
            if type(scores) is ScoreTable
            else {a: dict(row) for a, row in scores.items()}
        ),
    }


def spread_sample(rng: random.Random, n: int, k: int) -> range:
    """`k` positions that are distinct modulo `n` (for `k <= n`): a random start and a random stride coprime to `n`, so every
    position is equally likely and no two coincide; two draws from `rng` instead of
    `random.sample`'s `k` (which cost as much as the scoring it saves)."""
    stride = rng.randrange(1, n)
    while gcd(stride, n) != 1:
        stride += 1
    start = rng.randrange(n)
    return range(start, start + k * stride, stride)


def _describe(plugin: Plugin) -> dict[str, Any]:
    return {"type": plugin.type, "name": plugin.name}


EXHAUSTIVE_LIMIT = 128
"""Pools up to this size (after filters) are scored exhaustively."""
SAMPLE_SIZE = 64
"""Endpoints sampled uniformly into a large pool's shortlist."""
HINT_LIMIT = 32
"""Endpoints each `Shortlister` may add to a shortlist."""


@dataclass(slots=True, frozen=True)
class _FilterStep:
    plugin: Filter
    timing: PluginTiming
    prefers: bool
    """`KEEPS_FALLBACKS`: a preference, whose removed endpoints stay fallbacks."""
    identity_only: bool
    """`IDENTITY_ONLY`: its output is reused while the candidate list is the same."""


@dataclass(slots=True, frozen=True)
class _ScorerStep:
    plugin: Scorer
    timing: PluginTiming
    weight: float


@dataclass(slots=True, frozen=True)
class _Plan:
    """What one profile runs, resolved once: plugins, their flags, weights and timers."""

    filters: tuple[_FilterStep, ...]
    scorers: tuple[_ScorerStep, ...]
    score_calls: tuple[
        Callable[[CycleState, LLMRequest, list[EndpointState]], Sequence[float]], ...
    ]
    """The scorers' bound `score` methods, in order."""
    names: list[str]
    weights: list[float]
    fused: Totals
    """The weighted sums per endpoint with these weights, one comprehension (`fused_totals`)."""
    row: Row
    """A picked endpoint's weighted scores with these weights (`fused_row`)."""
    observe: Observe
    """The same, added to histogram children (`fused_observe`)."""
    picker: Picker
    picker_timing: PluginTiming
    shortlisters: tuple[Shortlister, ...]


def add_weighted(totals: list[float] | None, raw: Sequence[float], w: float) -> list[float]:
    """`totals` plus `w · clamp(raw)` element by element (`raw` alone when `totals` is None).

    A column with one value for everyone (the LoRA scorer for a base-model request, a
    prefix scorer when nothing matches, no-hit-lru for a warm prompt) is added as that
    one value: the same sums, without clamping each element.
    """
    n = len(raw)
    x = raw[0] if n else 0.0
    if n and (x is raw[-1] or x == raw[-1]) and raw.count(x) == n:
        c = w if x >= 1.0 else (w * x if x > 0.0 else 0.0)
        if totals is None:
            return [c] * n
        return totals if c == 0.0 else [t + c for t in totals]
    if totals is None:
        return [w if x >= 1.0 else (w * x if x > 0.0 else 0.0) for x in raw]
    return [
        t + (w if x >= 1.0 else (w * x if x > 0.0 else 0.0))
        for t, x in zip(totals, raw, strict=False)
    ]


FUSED_LIMIT = 8
"""Up to this many scored endpoints, the weighted sum is taken endpoint by endpoint once
every scorer has answered (the profile's `fused_totals`) instead of column by column as
each does (`add_weighted`): a Python pass per scorer costs more than the arithmetic in a
small pool."""


Totals = Callable[[Sequence[Sequence[float]]], list[float]]
Row = Callable[[Sequence[Sequence[float]], int], list[float]]


def _with_weights(
    name: str, weights: Sequence[float], body: str, names: Mapping[str, Any] | None = None
) -> Any:
    """Function `name` compiled from `body`, with the weights as closure variables
    `w0, w1, …` (the source text names only generated identifiers, never a value) and
    `names` as its globals."""
    ws = ", ".join(f"w{i}" for i in range(len(weights)))
    source = f"def make({ws}):\n{body}    return {name}\n"
    namespace: dict[str, Any] = dict(names or {})
    exec(compile(source, f"<{name} {len(weights)}>", "exec"), namespace)
    return namespace["make"](*weights)


def _clamped(i: int, x: str) -> str:
    return f"(w{i} if {x} >= 1.0 else (w{i} * x{i} if x{i} > 0.0 else 0.0))"


def fused_totals(weights: Sequence[float]) -> Totals:
    """Per endpoint, `Σ w · clamp(raw)` over the scorers, as one comprehension:
    `0.0 + w0·clamp(x0) + w1·clamp(x1) + …`, added in scorer order, so the same floats as
    `add_weighted` column by column (which starts from the first weighted value; `0.0 + v`
    is `v`), with no inner loop and no pairing of weights with scores; empty when there
    are no endpoints.

    Built once per profile (its scorers and weights are fixed). Costs 0.8–0.9 µs against
    1.2–1.6 for the same sums as a loop nest with 7 scorers over 1–2 endpoints, 2.2
    against 5.0 over 8 (one `timeit` run).
    """
    k = len(weights)
    if k == 0:
        return lambda raws: []
    xs = ", ".join(f"x{i}" for i in range(k))
    terms = " + ".join(_clamped(i, f"x{i}") for i in range(k))
    body = (
        "    def totals(raws):\n"
        f"        return [0.0 + {terms} for ({xs},) in zip(*raws, strict=True)]\n"
    )
    made: Totals = _with_weights("totals", weights, body)
    return made


def fused_row(weights: Sequence[float]) -> Row:
    """`ScoreTable.weighted_row`'s values for position `i`: `[w0·clamp(raws[0][i]), …]`,
    the same expressions, written out per scorer (0.24 against 0.79 µs for 7 scorers,
    one `timeit` run). `raws` must hold one column per weight (else ValueError)."""
    k = len(weights)
    if k == 0:
        return lambda raws, i: []
    rs = ", ".join(f"r{j}" for j in range(k))
    items = ", ".join(_clamped(j, f"(x{j} := r{j}[i])") for j in range(k))
    body = f"    def row(raws, i):\n        ({rs},) = raws\n        return [{items}]\n"
    made: Row = _with_weights("row", weights, body)
    return made


class Bins(Protocol):
    """A histogram child `ScoreTable.observe_row` adds to (the gateway's `Buckets`)."""

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float


Observe = Callable[[Sequence[Sequence[float]], int, Sequence[Bins]], None]


def fused_observe(weights: Sequence[float]) -> Observe:
    """`ScoreTable.observe_row`'s loop for position `i`, written out per scorer: the value
    `fused_row` gives (the same expression), its bucket by `bisect_left`, the sum; no
    list of values and no loop (`children` and `raws` must hold one item per weight, else
    ValueError)."""
    k = len(weights)
    if k == 0:
        return lambda raws, i, children: None
    rs = ", ".join(f"r{j}" for j in range(k))
    cs = ", ".join(f"c{j}" for j in range(k))
    lines = [
        f"    def observe(raws, i, children):\n        ({rs},) = raws\n        ({cs},) = children\n"
    ]
    for j in range(k):
        lines.append(
            f"        v = {_clamped(j, f'(x{j} := r{j}[i])')}\n"
            f"        c{j}.counts[bisect_left(c{j}.bounds, v)] += 1\n"
            f"        c{j}.sum += v\n"
        )
    made: Observe = _with_weights("observe", weights, "".join(lines), {"bisect_left": bisect_left})
    return made


def _wrong_length(plan: _Plan, raws: list[Sequence[float]], n: int) -> ValueError:
    """The error for the first scorer that did not return one score per endpoint."""
    scorer, raw = next((s, r) for s, r in zip(plan.scorers, raws, strict=True) if len(r) != n)
    return ValueError(f"scorer {scorer.plugin.name!r} returned {len(raw)} scores for {n} endpoints")


class Scheduler:
    """Runs `handler`'s profiles over the candidates; `plugins` are all configured plugins."""

    __slots__ = (
        "_complete_calls",
        "_filter_memo",
        "_hooks_complete",
        "_hooks_pre",
        "_hooks_recording",
        "_index",
        "_index_of",
        "_phase",
        "_plans",
        "_pre_calls",
        "_single",
        "_sticky",
        "_timings",
        "exhaustive_limit",
        "handler",
        "hint_limit",
        "plugins",
        "profiles",
        "sample_size",
        "stats",
        "timing_every",
        "warnings",
    )

    def __init__(
        self,
        profiles: Mapping[str, SchedulerProfile],
        handler: ProfileHandler,
        plugins: Mapping[str, Plugin],
        *,
        exhaustive_limit: int = EXHAUSTIVE_LIMIT,
        sample_size: int = SAMPLE_SIZE,
        hint_limit: int = HINT_LIMIT,
        timing_every: int = TIMING_EVERY,
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one scheduling profile")
        if sample_size < 1 or exhaustive_limit < sample_size:
            raise ValueError("need 1 <= sample_size <= exhaustive_limit")
        if timing_every < 1:
            raise ValueError("timing_every must be >= 1 (1 = time every call)")
        self.timing_every = timing_every
        """Plugins are timed on one cycle (and one hook call) in this many, the first
        included; each timed call counts for this many in `stats`."""
        self._phase = 1 % timing_every
        self._pre_calls = 0
        self._complete_calls = 0
        self.exhaustive_limit = exhaustive_limit
        self.sample_size = sample_size
        self.hint_limit = hint_limit
        self._index: dict[str, int] = {}
        self._index_of: list[EndpointState] | None = None
        self._filter_memo: dict[int, tuple[list[EndpointState], int, list[EndpointState]]] = {}
        """id(filter) → (the input list it last saw, its length, its output), for
        identity-only filters."""
        if isinstance(handler, ProfileSetCheck):
            handler.check_profiles(profiles)
        self.profiles = dict(profiles)
        self.handler = handler
        self.plugins = dict(plugins)
        self.stats = SchedulerStats()
        self.warnings: tuple[str, ...] = ()
        """What the picker config asks for that servegate does differently (logged at load)."""
        timed: list[tuple[str, Plugin]] = [(PROFILE_PICKER, handler), (PROCESS_RESULTS, handler)]
        for profile in self.profiles.values():
            timed.extend((FILTER, f) for f in profile.filters)
            timed.extend((SCORER, ws.scorer) for ws in profile.scorers)
            timed.append((PICKER, profile.picker))
        for point, plugin in timed:
            self.stats.plugins.setdefault((point, plugin.name), PluginTiming(plugin.type))
        self._timings = self.stats.plugins
        self._plans = {name: self._plan(profile) for name, profile in self.profiles.items()}
        """Each profile resolved once (profiles are fixed once the scheduler is built)."""
        self._single: tuple[str, SchedulerProfile] | None = None
        """The one profile, when the handler is known to run it alone and to turn its
        ranking into the decision (`only_result`): untimed cycles then run it without
        asking the handler."""
        if len(self.profiles) == 1 and type(handler) in (
            SingleProfileHandler,
            HeaderProfileHandler,
        ):
            self._single = next(iter(self.profiles.items()))
        self._sticky = None if self._single is None else StickyPath.of(self._single[1])
        """The default profile's shape in one call (`sticky.py`), for small pools on untimed
        cycles of the single profile; None when the profile has another shape."""
        hooks_pre = [p for p in self.plugins.values() if isinstance(p, PreRequest)]
        # plugins that read what the indexes held before this decision go first
        self._hooks_pre = sorted(
            hooks_pre, key=lambda p: not getattr(p, "reads_before_records", False)
        )
        self._hooks_recording = [p for p in self._hooks_pre if getattr(p, RECORDS_DECISIONS, True)]
        """The `PreRequest` plugins untimed calls run: those that may record something
        (a timed call runs them all, so every hook's duration series keeps its samples)."""
        self._hooks_complete = [p for p in self.plugins.values() if isinstance(p, ResponseComplete)]
        for hook in self._hooks_pre:
            self.stats.hooks.setdefault((PRE_REQUEST, hook.name), PluginTiming(hook.type))
        for done in self._hooks_complete:
            self.stats.hooks.setdefault((RESPONSE_COMPLETE, done.name), PluginTiming(done.type))

    # -- the decision ------------------------------------------------------------------
    def schedule(
        self, request: LLMRequest, candidates: list[EndpointState], cycle: CycleState
    ) -> Decision:
        """Choose an endpoint (and fallbacks) for `request` among `candidates`.

        Raises `NoCandidates` when nothing survives the filters.
        """
        stats = self.stats
        stats.cycles += 1
        if not candidates:
            stats.no_candidates += 1
            raise NoCandidates("no candidate endpoints")
        every = self.timing_every
        if stats.cycles % every != self._phase:
            single = self._single
            if single is not None:
                # what the handler would do, without asking it: run the one profile, and
                # its ranking is the decision (`only_result`)
                name, profile = single
                sticky = self._sticky
                n = len(candidates)
                if sticky is not None and n <= FUSED_LIMIT and n <= self.exhaustive_limit:
                    endpoints, spare, raws = sticky.scores(cycle, request, candidates)
                    result = self._ranked(self._plans[name], cycle, request, endpoints, raws, spare)
                else:
                    result = self._run_profile(profile, cycle, request, candidates, 0)
                if result is None:
                    stats.no_candidates += 1
                    raise NoCandidates(f"no endpoint survived the scheduling profiles ({name})")
                ranked = result.ranked
                return Decision(ranked[0], ranked[1:], None, name, {name: result})
            every = 0
        return self._schedule(request, candidates, cycle, every)

    def _schedule(
        self, request: LLMRequest, candidates: list[EndpointState], cycle: CycleState, weight: int
    ) -> Decision:
        """The handler's loop; plugins are timed when `weight` (each call counting for it)."""
        stats = self.stats
        handler = self.handler
        profiles = self.profiles
        timing = self._timings[(PROFILE_PICKER, handler.name)]
        results: dict[str, ProfileResult | None] = {}
        t0 = perf_counter_ns() if weight else 0
        names = handler.pick_profiles(cycle, request, profiles, results)
        if weight:
            timing.add(perf_counter_ns() - t0, weight)
        while names:
            for name in names:
                if name in results:
                    raise RuntimeError(
                        f"profile handler {handler.name!r} asked to run profile {name!r} twice"
                    )
                profile = profiles.get(name)
                if profile is None:
                    raise RuntimeError(
                        f"profile handler {handler.name!r} asked for unknown profile {name!r}"
                    )
                results[name] = self._run_profile(profile, cycle, request, candidates, weight)
            t0 = perf_counter_ns() if weight else 0
            names = handler.pick_profiles(cycle, request, profiles, results)
            if weight:
                timing.add(perf_counter_ns() - t0, weight)
        t0 = perf_counter_ns() if weight else 0
        decision = handler.process_results(cycle, request, results)
        if weight:
            self._timings[(PROCESS_RESULTS, handler.name)].add(perf_counter_ns() - t0, weight)
        if decision is None:
            stats.no_candidates += 1
            ran = ", ".join(results) or "none"
            raise NoCandidates(f"no endpoint survived the scheduling profiles ({ran})")
        return decision

    def _plan(self, profile: SchedulerProfile) -> _Plan:
        timings = self._timings
        return _Plan(
            filters=tuple(
                _FilterStep(
                    f,
                    timings[(FILTER, f.name)],
                    bool(getattr(f, KEEPS_FALLBACKS, False)),
                    bool(getattr(f, IDENTITY_ONLY, False)),
                )
                for f in profile.filters
            ),
            scorers=tuple(
                _ScorerStep(ws.scorer, timings[(SCORER, ws.scorer.name)], ws.weight)
                for ws in profile.scorers
            ),
            score_calls=tuple(ws.scorer.score for ws in profile.scorers),
            names=[ws.scorer.name for ws in profile.scorers],
            weights=[ws.weight for ws in profile.scorers],
            fused=fused_totals([ws.weight for ws in profile.scorers]),
            row=fused_row([ws.weight for ws in profile.scorers]),
            observe=fused_observe([ws.weight for ws in profile.scorers]),
            picker=profile.picker,
            picker_timing=timings[(PICKER, profile.picker.name)],
            shortlisters=tuple(
                ws.scorer for ws in profile.scorers if isinstance(ws.scorer, Shortlister)
            ),
        )

    def _run_profile(
        self,
        profile: SchedulerProfile,
        cycle: CycleState,
        request: LLMRequest,
        candidates: list[EndpointState],
        weight: int,
    ) -> ProfileResult | None:
        """One profile's filters, scorers and picker; timed when `weight` is not 0."""
        plan = self._plans[profile.name]
        endpoints = candidates
        memo = self._filter_memo
        remembered: list[EndpointState] | None = None
        spare: list[EndpointState] = []
        """Endpoints a preference filter (`KEEPS_FALLBACKS`) removed: last-resort fallbacks."""
        t0 = perf_counter_ns() if weight else 0
        for step in plan.filters:
            flt = step.plugin
            if step.prefers and len(endpoints) > self.exhaustive_limit:
                # a preference filter scores every endpoint it is given (the prefix
                # affinity filter matches the prompt against each): in a large pool it
                # chooses among the shortlist (the indexes' holders are on it), never
                # empties it, and what it drops stays a fallback
                endpoints = self._shortlist(plan, cycle, request, endpoints)
            before = endpoints
            if step.identity_only:
                seen = memo.get(id(flt))
                if seen is not None and seen[0] is endpoints and seen[1] == len(endpoints):
                    endpoints = seen[2]
                else:
                    out = flt.filter(cycle, request, endpoints)
                    memo[id(flt)] = (endpoints, len(endpoints), out)
                    endpoints = out
                remembered = endpoints
            else:
                endpoints = flt.filter(cycle, request, endpoints)
            if step.prefers:
                if len(endpoints) < len(before):
                    kept = set(endpoints)  # `EndpointState` hashes by identity
                    spare = [*spare, *filterfalse(kept.__contains__, before)]
            else:
                spare = []
            if weight:
                t1 = perf_counter_ns()
                step.timing.add(t1 - t0, weight)
                t0 = t1
            if not endpoints:
                return None
        if len(endpoints) > self.exhaustive_limit:
            endpoints = self._shortlist(plan, cycle, request, endpoints)
        elif endpoints is candidates or endpoints is remembered:
            endpoints = list(endpoints)  # lists others hold are never handed to plugins
        if weight:
            raws: list[Sequence[float]] = []
            for scoring in plan.scorers:
                raw = scoring.plugin.score(cycle, request, endpoints)
                raws.append(raw)
                t1 = perf_counter_ns()
                scoring.timing.add(t1 - t0, weight)
                t0 = t1
        else:
            raws = [score(cycle, request, endpoints) for score in plan.score_calls]
        return self._ranked(plan, cycle, request, endpoints, raws, spare, weight)

    def _ranked(
        self,
        plan: _Plan,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
        raws: list[Sequence[float]],
        spare: list[EndpointState],
        weight: int = 0,
    ) -> ProfileResult | None:
        """The weighted sums of the scorers' `raws` for `endpoints`, the picker's ranking,
        and `spare` (what a preference filter removed) after it; the picker is timed when
        `weight` is not 0."""
        n = len(endpoints)
        if not raws:
            totals = [0.0] * n
        elif n <= FUSED_LIMIT:
            try:
                totals = plan.fused(raws)  # (unequal lengths: ValueError)
            except ValueError:
                totals = []
            if len(totals) != n:
                raise _wrong_length(plan, raws, n)
        else:
            if list(map(len, raws)).count(n) != len(raws):
                raise _wrong_length(plan, raws, n)
            weights = plan.weights
            totals = add_weighted(None, raws[0], weights[0])
            for raw, w in zip(raws[1:], weights[1:], strict=True):
                totals = add_weighted(totals, raw, w)
        if weight:
            t0 = perf_counter_ns()  # the framework's sum: no plugin's time
        ranked = plan.picker.pick(cycle, request, endpoints, totals)
        if weight:
            plan.picker_timing.add(perf_counter_ns() - t0, weight)
        if not ranked:
            return None
        if spare:
            ranked = [*ranked, *spare]
        return ProfileResult(  # (positional: cheaper than keywords)
            ranked,
            ScoreTable(endpoints, plan.names, plan.weights, raws, plan.row, plan.observe),
            TotalsView(endpoints, totals),
        )

    def _shortlist(
        self,
        plan: _Plan,
        cycle: CycleState,
        request: LLMRequest,
        endpoints: list[EndpointState],
    ) -> list[EndpointState]:
        """The hinted endpoints plus a uniform sample, in pool order; or all if a hint can't."""
        n = len(endpoints)
        picked: set[int] = set()
        shortlisters = plan.shortlisters
        if shortlisters:
            index = self._address_index(endpoints)
            for scorer in shortlisters:
                named = scorer.shortlist(cycle, request, self.hint_limit)
                if named is None:
                    return list(endpoints)
                for address in named:
                    i = index.get(address)
                    if i is not None:
                        picked.add(i)
        picked.update(map(n.__rmod__, spread_sample(cycle.rng, n, self.sample_size)))
        self.stats.shortlisted += 1
        return list(map(endpoints.__getitem__, sorted(picked)))

    def _address_index(self, endpoints: list[EndpointState]) -> dict[str, int]:
        """address → position, remembered for the last list seen (the pool hands out one
        list per membership change, so a steady pool pays for this once)."""
        index = self._index
        if (
            endpoints is not self._index_of
            or len(index) != len(endpoints)
            or index.get(endpoints[-1].endpoint.address) != len(endpoints) - 1
        ):
            index = self._index = {s.endpoint.address: i for i, s in enumerate(endpoints)}
            self._index_of = endpoints
        return index

    # -- hooks the gateway calls around the request -----------------------------------
    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        """Tell every `PreRequest` plugin what was decided, before the request is sent."""
        self._pre_calls += 1
        every = self.timing_every
        if self._pre_calls % every != self._phase:
            for plugin in self._hooks_recording:
                plugin.pre_request(request, decision, now)
            return
        hooks = self.stats.hooks
        for plugin in self._hooks_pre:
            t0 = perf_counter_ns()
            plugin.pre_request(request, decision, now)
            hooks[(PRE_REQUEST, plugin.name)].add(perf_counter_ns() - t0, every)

    def response_complete(self, request: LLMRequest, endpoint: EndpointState, now: float) -> None:
        """Tell every `ResponseComplete` plugin that `endpoint` finished serving `request`."""
        self._complete_calls += 1
        every = self.timing_every
        if self._complete_calls % every != self._phase:
            for plugin in self._hooks_complete:
                plugin.response_complete(request, endpoint, now)
            return
        hooks = self.stats.hooks
        for plugin in self._hooks_complete:
            t0 = perf_counter_ns()
            plugin.response_complete(request, endpoint, now)
            hooks[(RESPONSE_COMPLETE, plugin.name)].add(perf_counter_ns() - t0, every)

    # -- introspection ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The resolved configuration as plain data (for `servegate config check`)."""
        return {
            "profileHandler": _describe(self.handler),
            "schedulingProfiles": [
                {
                    "name": name,
                    "filters": [_describe(f) for f in profile.filters],
                    "scorers": [
                        {**_describe(ws.scorer), "weight": ws.weight} for ws in profile.scorers
                    ],
                    "picker": _describe(profile.picker),
                }
                for name, profile in self.profiles.items()
            ],
            "plugins": [_describe(p) for p in self.plugins.values()],
            "warnings": list(self.warnings),
        }
