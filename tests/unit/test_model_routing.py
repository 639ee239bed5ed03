import math
import random

import pytest

from servegate.config import parse_config
from servegate.gateway.model_routing import (
    RoutingTable,
    Split,
    Target,
    random_choice,
    sticky_choice,
)

SPLIT = Split((Target("v1", 90), Target("v2", 10)), sticky_header="x-session-id")


def _table(doc: str) -> RoutingTable:
    return RoutingTable.from_config(parse_config(doc, environ={}).model_rewrites)


def _within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_random_choice_follows_the_weights() -> None:
    rng = random.Random(1)
    n = 20000
    v2 = sum(random_choice(SPLIT, rng).model == "v2" for _ in range(n))
    assert _within(v2, n, 0.1), v2


def test_a_zero_weight_target_is_never_chosen() -> None:
    split = Split((Target("off", 0), Target("on", 1), Target("off2", 0)))
    rng = random.Random(2)
    assert {random_choice(split, rng).model for _ in range(500)} == {"on"}
    assert {sticky_choice(split, f"s{i}").model for i in range(500)} == {"on"}


def test_sticky_choice_is_a_function_of_the_session_and_follows_the_weights() -> None:
    n = 20000
    picks = [sticky_choice(SPLIT, f"session-{i}").model for i in range(n)]
    again = [sticky_choice(SPLIT, f"session-{i}").model for i in range(n)]
    assert picks == again
    assert _within(picks.count("v2"), n, 0.1), picks.count("v2")


def test_raising_a_weight_moves_only_sessions_towards_it() -> None:
    after = Split((Target("v1", 80), Target("v2", 20)))
    n = 20000
    before_picks = [sticky_choice(SPLIT, f"s{i}").model for i in range(n)]
    after_picks = [sticky_choice(after, f"s{i}").model for i in range(n)]
    moved = [(b, a) for b, a in zip(before_picks, after_picks, strict=True) if b != a]
    assert all(pair == ("v1", "v2") for pair in moved)
    # 10 % of all sessions must move from v1 to v2; rendezvous hashing moves no more.
    assert _within(len(moved), n, 0.1), len(moved)


REWRITES = """
pools:
- {name: a, models: [{id: v1}, {id: v2}]}
- {name: b, models: [{id: other}]}
model_rewrites:
- rules:
  - matches: [{model: public}]
    targets: [{modelRewrite: v1, weight: 90}, {modelRewrite: v2, weight: 10}]
  sticky: {header: X-Session-ID}
- poolRef: b
  rules:
  - matches: []
    targets: [{modelRewrite: other}]
"""


@pytest.mark.parametrize(
    ("model", "headers", "served", "expected"),
    [
        ("v1", {}, True, ("v1", None, False)),
        ("public", {"x-session-id": "abc"}, False, None),
        ("unknown", {}, False, ("other", "b", True)),
        ("v2", {}, True, ("v2", None, False)),
    ],
    ids=[
        "served-model-passes",
        "alias-sticky",
        "catch-all-for-unknown",
        "catch-all-not-for-served",
    ],
)
def test_route(
    model: str, headers: dict[str, str], served: bool, expected: tuple[str, str | None, bool] | None
) -> None:
    table = _table(REWRITES)
    routed = table.route(model, headers, random.Random(0), served)
    if expected is None:
        assert routed.rewritten and routed.model in {"v1", "v2"}
        same = {table.route(model, headers, random.Random(i), served).model for i in range(50)}
        assert same == {routed.model}
    else:
        assert (routed.model, routed.pool, routed.rewritten) == expected


def test_route_without_a_session_header_splits_at_random() -> None:
    table = _table(REWRITES)
    rng = random.Random(3)
    seen = {table.route("public", {}, rng).model for _ in range(400)}
    assert seen == {"v1", "v2"}


def test_targets_lists_every_rewrite_target() -> None:
    assert _table(REWRITES).targets() == {"v1", "v2", "other"}
