"""How a plugin finds the prefix match it reads: a prefix scorer, or a producer's inner one.

Several plugins (the approximate scorer bound to a producer, the affinity filter, the
P/D decider, the P2P source producer) read another plugin's prefix match. The lookup
lives here, apart from every plugin module, so that those modules import it and not
each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from mypy_extensions import mypyc_attr

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.framework import CycleState, Decision, Plugin, Scorer
from servegate.scheduling.request import LLMRequest

if TYPE_CHECKING:
    from servegate.scheduling.prefix.approx import PrefixCacheScorer
    from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer

PREFIX_SCORER_TYPES = ("prefix-cache-scorer", "precise-prefix-cache-scorer")
PREFIX_PRODUCER_TYPES = ("approx-prefix-cache-producer", "precise-prefix-cache-producer")
PRODUCER_KIND = "producer"


# The producers (scheduling/producers.py, plain Python) subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixProducer:
    """Base of the prefix producers: an inner scorer computes the match, consumers read it.

    Not a `Scorer` (no `score` method): a producer cannot sit in a profile, as in llm-d.
    """

    type: ClassVar[str]
    kind: ClassVar[str] = PRODUCER_KIND
    source: PrefixCacheScorer | PrecisePrefixCacheScorer

    def __init__(self, name: str) -> None:
        self.name = name

    def match(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        """Per endpoint: the share of the prompt's blocks it holds (tier-weighted when precise)."""
        return self.source.score(cycle, request, endpoints)

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        hook = getattr(self.source, "pre_request", None)
        if hook is not None:
            hook(request, decision, now)

    def startup_warnings(self) -> list[str]:
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def producer_source(plugin: Plugin) -> Scorer | None:
    """The match-computing scorer inside a prefix producer (llm-d's producer/consumer split)."""
    inner = getattr(plugin, "source", None)
    if getattr(plugin, "kind", None) == "producer" and isinstance(inner, Scorer):
        return inner
    return None


def find_prefix_scorer(
    owner: str, plugins: Mapping[str, Plugin], name: str | None, parameter: str
) -> Scorer:
    """The prefix match a plugin reads: the scorer or producer named, or the only one declared.

    A prefix producer (`approx-prefix-cache-producer`, `precise-prefix-cache-producer`)
    counts as its match; with none named, declared prefix scorers come first, then
    producers.
    """
    if name is not None:
        plugin = plugins.get(name)
        if plugin is None:
            raise ValueError(f"{parameter} {name!r} names no declared plugin")
        inner = producer_source(plugin)
        if inner is not None:
            return inner
        if plugin.type not in PREFIX_SCORER_TYPES or not isinstance(plugin, Scorer):
            raise ValueError(
                f"{parameter} {name!r} is a {plugin.type!r}; it must name a "
                + " or ".join((*PREFIX_SCORER_TYPES, *PREFIX_PRODUCER_TYPES))
            )
        return plugin
    found = [p for p in plugins.values() if p.type in PREFIX_SCORER_TYPES]
    if not found:
        found = [p for p in plugins.values() if producer_source(p) is not None]
        if len(found) == 1:
            inner = producer_source(found[0])
            assert inner is not None
            return inner
    if len(found) == 1 and isinstance(found[0], Scorer):
        return found[0]
    if not found:
        raise ValueError(
            f"{owner} reads a prefix match; declare a prefix-cache-scorer, "
            "precise-prefix-cache-scorer or a prefix producer (approx-prefix-cache-producer, "
            "precise-prefix-cache-producer)"
        )
    raise ValueError(
        f"several prefix scorers or producers are declared ({', '.join(p.name for p in found)}); "
        f"say which one with `{parameter}`"
    )


class CycleMatch:
    """One prefix scorer's scores in one cycle, shared by every plugin that reads them.

    The affinity filter, the scorer itself and `no-hit-lru-scorer` all ask for the same
    match, usually over the same endpoints the first of them was given (the filter passes
    its input on unchanged when nothing is sticky); those get the scores back as they
    are, after one comparison of the lists. Any other list (the filter's survivors) is
    answered endpoint by endpoint from what was scored so far, once: the scorers after
    the filter are all handed its one output, so the answer for the last such list is
    kept too. `EndpointState` compares and hashes by identity, so all of it runs in C.
    """

    __slots__ = ("_by_state", "_other", "_other_scores", "endpoints", "scores")

    def __init__(self, endpoints: list[EndpointState], scores: Sequence[float]) -> None:
        self.endpoints = list(endpoints)
        self.scores = scores
        self._by_state: dict[EndpointState, float] | None = None
        self._other: list[EndpointState] | None = None
        self._other_scores: list[float] = []

    def same_list(self, endpoints: list[EndpointState]) -> bool:
        """Whether `endpoints` are the endpoints scored, in the same order."""
        return endpoints == self.endpoints

    def by_state(self) -> dict[EndpointState, float]:
        """endpoint → score, for every endpoint scored this cycle."""
        known = self._by_state
        if known is None:
            known = self._by_state = dict(zip(self.endpoints, self.scores, strict=True))
        return known

    def lookup(self, endpoints: list[EndpointState]) -> Sequence[float] | None:
        """The scores of `endpoints`, in their order, when every one was scored; else None."""
        if endpoints == self.endpoints:
            return self.scores
        if endpoints == self._other:
            return self._other_scores
        try:
            out = list(map(self.by_state().__getitem__, endpoints))
        except KeyError:
            return None
        self._other = list(endpoints)
        self._other_scores = out
        return out


def _match_key(name: str) -> str:
    return f"prefix-scores/{name}"


def already_scored(
    cycle: CycleState, name: str, endpoints: list[EndpointState]
) -> Sequence[float] | None:
    """The scores `prefix_scores` already computed this cycle for scorer `name`, when it
    covered every one of `endpoints` (a filter asked first: the scorer need not match the
    prompt again); else None."""
    shared: CycleMatch | None = cycle.data.get(_match_key(name))
    if shared is None:
        return None
    return shared.lookup(endpoints)


def keep_match(
    cycle: CycleState, name: str, endpoints: list[EndpointState], scores: Sequence[float]
) -> None:
    """Leave scorer `name`'s `scores` of `endpoints` for this cycle's later readers, as
    `prefix_scores` does when it computes them (the latency layer's dispatch reads the
    picked endpoint's after the decision)."""
    cycle.data[_match_key(name)] = CycleMatch(endpoints, scores)


def prefix_scores(
    cycle: CycleState, scorer: Scorer, request: LLMRequest, endpoints: list[EndpointState]
) -> Sequence[float]:
    """`scorer`'s scores for `endpoints`, computed once per cycle and shared (read-only)."""
    key = _match_key(scorer.name)
    shared: CycleMatch | None = cycle.data.get(key)
    if shared is None:
        scores = scorer.score(cycle, request, endpoints)
        cycle.data[key] = CycleMatch(endpoints, scores)
        return scores
    known_scores = shared.lookup(endpoints)
    if known_scores is not None:
        return known_scores
    known = shared.by_state()
    missing = [s for s in endpoints if s not in known]
    known.update(zip(missing, scorer.score(cycle, request, missing), strict=True))
    return list(map(known.__getitem__, endpoints))


def find_prefix_producer(
    plugins: Mapping[str, object], name: str | None, parameter: str
) -> PrefixProducer | None:
    """The producer a consumer reads: the one named, else one declared under its type name."""
    if name:
        plugin = plugins.get(name)
        if plugin is None:
            raise ValueError(
                f"{parameter} {name!r} names no declared plugin; declare an "
                "approx-prefix-cache-producer or precise-prefix-cache-producer with that name"
            )
        if not isinstance(plugin, PrefixProducer):
            raise ValueError(
                f"{parameter} {name!r} is a {getattr(plugin, 'type', '?')!r}, not a prefix "
                "producer (approx-prefix-cache-producer, precise-prefix-cache-producer)"
            )
        return plugin
    for default in PREFIX_PRODUCER_TYPES:
        plugin = plugins.get(default)
        if isinstance(plugin, PrefixProducer):
            return plugin
    return None
