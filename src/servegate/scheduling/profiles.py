"""Profile handlers: which scheduling profiles run, and how results become a Decision.

The scheduler asks the handler for profiles to run, runs them, and asks again
with the results so far until the handler answers with none; then the handler
turns the results into a `Decision`. A P/D handler fits the same loop: answer
`["decode"]` first, then, if its decider wants a prefill leg, `["prefill"]`,
then nothing; `process_results` puts the prefill winner in `Decision.prefill`.

A handler that only works with particular profiles implements `ProfileSetCheck`
so that a wrong configuration fails at load time, not on the first request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol, runtime_checkable

from servegate.scheduling.framework import CycleState, Decision, ProfileResult, SchedulerProfile
from servegate.scheduling.registry import (
    ParameterlessPlugin,
)
from servegate.scheduling.request import LLMRequest


@runtime_checkable
class ProfileSetCheck(Protocol):
    def check_profiles(self, profiles: Mapping[str, SchedulerProfile]) -> None:
        """Raise `ValueError` saying how to fix it when this handler cannot run `profiles`."""
        ...


class SingleProfileHandler(ParameterlessPlugin):
    """Runs the one configured profile; its ranking is the decision."""

    __slots__ = ()
    type: ClassVar[str] = "single-profile-handler"

    def check_profiles(self, profiles: Mapping[str, SchedulerProfile]) -> None:
        if len(profiles) != 1:
            names = ", ".join(profiles) or "none"
            raise ValueError(
                f"{self.type} runs exactly one scheduling profile, but {len(profiles)} are "
                f"configured ({names}); keep one profile, or configure a profile handler "
                "that runs several"
            )

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if results:
            return []
        return list(profiles)

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        for name, result in results.items():
            if result is None or not result.ranked:
                return None
            ranked = result.ranked
            return Decision(
                endpoint=ranked[0], fallbacks=ranked[1:], profile=name, results={name: result}
            )
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
