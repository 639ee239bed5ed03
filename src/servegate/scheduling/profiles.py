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
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

from pydantic import Field

from servegate.scheduling.factory import (
    ParameterlessPlugin,
    Parameters,
    PluginContext,
    decode_parameters,
)
from servegate.scheduling.framework import CycleState, Decision, ProfileResult, SchedulerProfile
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
        return only_result(results)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def only_result(results: Mapping[str, ProfileResult | None]) -> Decision | None:
    """The decision of a handler that ran one profile: its ranking, or None if it found none."""
    for name, result in results.items():
        if result is None or not result.ranked:
            return None
        ranked = result.ranked
        return Decision(
            endpoint=ranked[0], fallbacks=ranked[1:], profile=name, results={name: result}
        )
    return None


class HeaderProfileParameters(Parameters):
    header_name: str = Field("EPP-Profile", alias="headerName", min_length=1)
    default_profile: str = Field("decode", alias="defaultProfile", min_length=1)


class HeaderProfileHandler:
    """`header-profile-handler`: runs the one profile a request header names.

    One profile configured: it always runs. Several: the profile named by the header
    (`headerName`, case-insensitive name, value matched exactly) runs alone; a
    missing or blank header runs `defaultProfile`; a value naming no profile runs
    nothing, so the request finds no endpoint (as in llm-d).
    """

    __slots__ = ("default_profile", "header", "name")
    type: ClassVar[str] = "header-profile-handler"

    def __init__(self, name: str, params: HeaderProfileParameters) -> None:
        self.name = name
        self.header = params.header_name.lower()
        self.default_profile = params.default_profile

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(HeaderProfileParameters, cls.type, name, parameters))

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if results:
            return []
        if len(profiles) == 1:
            return list(profiles)
        wanted = request.headers.get(self.header, "").strip() or self.default_profile
        return [wanted] if wanted in profiles else []

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        return only_result(results)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
