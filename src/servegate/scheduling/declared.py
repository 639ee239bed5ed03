"""Plugins declared under `plugins` that are not filters, scorers or pickers.

llm-d's current router declares more than scheduling plugins in the same list:
request parsers, data-layer sources and extractors, data producers, flow-control
policies, admitters. Each is referenced from its own section (`requestHandler`,
`dataLayer`, `flowControl`) or by a consumer's parameter, never from a profile.
`DeclaredPlugin` is their common shape: a type, a name, strictly decoded
parameters, the `kind` the loader checks references against, and the startup
warnings the plugin owes when part of its meaning does not exist in servegate.

A warning names the plugin and says why; the loader logs each once and
`servegate config check` prints them. Nothing is ever silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

from servegate.scheduling.factory import (
    NoParameters,
    Parameters,
    PluginContext,
    decode_parameters,
)

ParamsModel = type[Parameters]
"""A plugin's parameter model (a module-level alias: `type` is a class attribute below)."""


@runtime_checkable
class StartupWarnings(Protocol):
    """A plugin that has something to say once at startup (what it cannot do here)."""

    def startup_warnings(self) -> Sequence[str]: ...


class DeclaredPlugin:
    """Base of the non-scheduling plugins: decoded parameters and optional warnings.

    Subclasses set `type`, `kind` (what sections may reference it as), the
    parameter model, and `unsupported` (why the plugin has no effect in servegate;
    empty when it is implemented).
    """

    __slots__ = ("name", "params")
    type: ClassVar[str]
    kind: ClassVar[str]
    parameters_model: ClassVar[ParamsModel] = NoParameters
    unsupported: ClassVar[str] = ""

    def __init__(self, name: str | None = None, params: Parameters | None = None) -> None:
        self.name = name or self.type
        self.params = params if params is not None else self.parameters_model()

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(cls.parameters_model, cls.type, name, parameters))

    def label(self) -> str:
        return f"{self.name!r} (type {self.type!r})" if self.name != self.type else repr(self.name)

    def warnings(self) -> list[str]:
        """Reasons beyond `unsupported`, from the parameters; subclasses extend."""
        return []

    def startup_warnings(self) -> list[str]:
        out = [f"plugin {self.label()}: {self.unsupported}"] if self.unsupported else []
        out.extend(f"plugin {self.label()}: {w}" for w in self.warnings())
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
