"""Model-level routing: a public model name → a weighted target model, before any pool.

Unsticky splits draw from the injected RNG. Sticky splits hash the session id
with each target (weighted rendezvous hashing): a session keeps its target for
as long as the weights stay, and when they change only the sessions the new
weights must move do move.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from servegate.rewrites import ModelRewrite

_SCALE = float(1 << 64)


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    weight: int


@dataclass(frozen=True, slots=True)
class Split:
    """One rule's targets, where they are looked up, and how sessions stick."""

    targets: tuple[Target, ...]
    pool: str | None = None
    sticky_header: str | None = None
    name: str = ""
    """The rewrite's name (`InferenceModelRewrite` metadata.name), for the metrics."""

    @property
    def total(self) -> int:
        return sum(t.weight for t in self.targets)


def _unit(session: str, model: str) -> float:
    digest = hashlib.blake2b(f"{model}\x00{session}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SCALE


def sticky_choice(split: Split, session: str) -> Target:
    """The target with the highest weighted rendezvous score (`-w / ln u`) for this session."""
    best: Target | None = None
    best_score = -math.inf
    for target in split.targets:
        if target.weight <= 0:
            continue
        score = -target.weight / math.log(_unit(session, target.model))
        if score > best_score:
            best, best_score = target, score
    assert best is not None
    return best


def random_choice(split: Split, rng: random.Random) -> Target:
    point = rng.random() * split.total
    for target in split.targets:
        point -= target.weight
        if point < 0 and target.weight > 0:
            return target
    return next(t for t in reversed(split.targets) if t.weight > 0)


@dataclass(frozen=True, slots=True)
class Routed:
    """Where one request goes: the model the replica sees, and the pool to look it up in."""

    model: str
    pool: str | None
    rewritten: bool
    rule: str = ""
    """The name of the rewrite that chose `model`, when one did."""


class RoutingTable:
    """Public names and their splits; immutable, swapped whole on reload."""

    def __init__(self, splits: Mapping[str, Split], fallback: Split | None = None) -> None:
        self.splits = dict(splits)
        self.fallback = fallback

    @classmethod
    def from_config(cls, rewrites: tuple[ModelRewrite, ...]) -> RoutingTable:
        splits: dict[str, Split] = {}
        fallback = None
        for rewrite in rewrites:
            header = rewrite.sticky.header.lower() if rewrite.sticky is not None else None
            for rule in rewrite.rules:
                split = Split(
                    tuple(Target(t.target, t.weight) for t in rule.targets),
                    rewrite.pool_ref,
                    header,
                    rewrite.name or "",
                )
                if not rule.matches:
                    fallback = split
                for match in rule.matches:
                    splits[match.model] = split
        return cls(splits, fallback)

    def targets(self) -> set[str]:
        out = {t.model for s in self.splits.values() for t in s.targets}
        if self.fallback is not None:
            out.update(t.model for t in self.fallback.targets)
        return out

    def route(
        self,
        model: str,
        headers: Mapping[str, str],
        rng: random.Random,
        served: bool = False,
    ) -> Routed:
        """`served`: some pool serves `model` itself, so the catch-all rule does not apply."""
        split = self.splits.get(model)
        if split is None and not served:
            split = self.fallback
        if split is None:
            return Routed(model, None, False)
        session = headers.get(split.sticky_header, "") if split.sticky_header else ""
        target = sticky_choice(split, session) if session else random_choice(split, rng)
        return Routed(target.model, split.pool, target.model != model, split.name)
