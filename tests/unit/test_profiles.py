"""The single-profile handler and the handler contract."""

from __future__ import annotations

import random

import pytest

from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import (
    CycleState,
    ProfileHandler,
    ProfileResult,
    SchedulerProfile,
)
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.profiles import ProfileSetCheck, SingleProfileHandler
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import addresses, endpoint_state

REQUEST = LLMRequest("r1", RequestKind.CHAT, "m", "m", "m")
CYCLE = CycleState(now=1.0, rng=random.Random(0))


def profile(name: str) -> SchedulerProfile:
    return SchedulerProfile(name, [], [], MaxScorePicker())


def test_single_profile_handler_implements_the_contracts() -> None:
    handler = SingleProfileHandler()
    assert isinstance(handler, ProfileHandler)
    assert isinstance(handler, ProfileSetCheck)
    assert handler.name == handler.type == "single-profile-handler"


def test_single_profile_handler_runs_its_profile_once() -> None:
    handler = SingleProfileHandler()
    profiles = {"only": profile("only")}
    assert handler.pick_profiles(CYCLE, REQUEST, profiles, {}) == ["only"]
    assert handler.pick_profiles(CYCLE, REQUEST, profiles, {"only": None}) == []


def test_single_profile_handler_turns_the_ranking_into_a_decision() -> None:
    eps = [endpoint_state(a) for a in addresses(3)]
    result = ProfileResult(ranked=[eps[2], eps[0], eps[1]], scores={}, totals={})
    decision = SingleProfileHandler().process_results(CYCLE, REQUEST, {"only": result})
    assert decision is not None
    assert decision.endpoint is eps[2]
    assert decision.fallbacks == [eps[0], eps[1]]
    assert decision.targets == [eps[2], eps[0], eps[1]]
    assert decision.profile == "only"
    assert decision.results == {"only": result}
    assert decision.prefill is None


@pytest.mark.parametrize(
    "results",
    [
        pytest.param({"only": None}, id="profile-had-no-candidates"),
        pytest.param({"only": ProfileResult(ranked=[], scores={}, totals={})}, id="empty-ranking"),
        pytest.param({}, id="nothing-ran"),
    ],
)
def test_single_profile_handler_without_a_winner_decides_nothing(
    results: dict[str, ProfileResult | None],
) -> None:
    assert SingleProfileHandler().process_results(CYCLE, REQUEST, results) is None


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        pytest.param(["a", "b"], "but 2 are configured (a, b)", id="two"),
        pytest.param([], "but 0 are configured (none)", id="none"),
    ],
)
def test_single_profile_handler_rejects_other_than_one_profile(
    names: list[str], fragment: str
) -> None:
    with pytest.raises(ValueError, match="runs exactly one scheduling profile") as info:
        SingleProfileHandler().check_profiles({n: profile(n) for n in names})
    assert fragment in str(info.value)


def test_single_profile_handler_accepts_one_profile() -> None:
    SingleProfileHandler().check_profiles({"x": profile("x")})


def test_single_profile_handler_takes_no_parameters() -> None:
    assert SingleProfileHandler.from_config("h", {}, PluginContext()).name == "h"
    with pytest.raises(PluginParameterError, match="unknown parameter 'profiles'"):
        SingleProfileHandler.from_config("h", {"profiles": ["a"]}, PluginContext())
