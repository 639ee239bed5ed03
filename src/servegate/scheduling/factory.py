"""What a plugin factory receives: the shared context and strictly decoded parameters.

A factory turns `(name, parameters, context)` from an `EndpointPickerConfig`
into a plugin. Parameters are decoded strictly with llm-d's camelCase names:
an unknown key or a wrong type is a `PluginParameterError` naming the plugin,
the key and what is accepted. Plugin modules import this, never `registry.py`
(which imports every plugin module), so the two form no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from servegate.scheduling.framework import Plugin

T = TypeVar("T")
P = TypeVar("P", bound="Parameters")

_NO_SERVICES: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a factory may need besides its own parameters, shared by every plugin.

    `services` carries shared, process-wide objects by well-known key (for
    example a prefix index fed by KV events) so that plugins added later can
    receive them without changing the factory signature.
    """

    staleness_s: float = 2.0
    """Age in seconds after which an endpoint's scraped metrics count as stale."""
    services: Mapping[str, object] = field(default_factory=lambda: _NO_SERVICES)

    def service(self, key: str, kind: type[T]) -> T:
        """The shared service under `key`, checked to be a `kind`."""
        value = self.services.get(key)
        if value is None:
            known = ", ".join(sorted(self.services)) or "none"
            raise LookupError(f"no shared service {key!r} is available (available: {known})")
        if not isinstance(value, kind):
            raise TypeError(
                f"shared service {key!r} is a {type(value).__name__}, expected {kind.__name__}"
            )
        return value


PluginFactory = Callable[[str, Mapping[str, Any], PluginContext], Plugin]


class Parameters(BaseModel):
    """Base of every plugin's parameters: frozen, strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=False)


class NoParameters(Parameters):
    """For plugins that take none: any key given is an error."""


class ParameterlessPlugin:
    """Constructor, factory and repr shared by plugins without parameters."""

    __slots__ = ("name",)
    type: ClassVar[str]

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        decode_parameters(NoParameters, cls.type, name, parameters)
        return cls(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PluginParameterError(ValueError):
    """A plugin's `parameters` block does not decode; the message says how to fix it."""

    def __init__(self, plugin_type: str, name: str, problems: list[str]) -> None:
        self.plugin_type = plugin_type
        self.name = name
        self.problems = problems
        label = f"plugin {name!r} (type {plugin_type!r})" if name != plugin_type else plugin_type
        super().__init__(f"{label}: " + "; ".join(problems))


def location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a path: `matchExpressions[0].values`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _accepted(model: type[BaseModel]) -> list[str]:
    return [info.alias or field_name for field_name, info in model.model_fields.items()]


def decode_parameters(
    model: type[P], plugin_type: str, name: str, raw: Mapping[str, Any] | None
) -> P:
    """Decode `raw` into `model`, or raise `PluginParameterError` listing every problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PluginParameterError(
            plugin_type,
            name,
            [f"`parameters` must be a mapping, got {type(raw).__name__}"],
        )
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        accepted = _accepted(model)
        known = ", ".join(accepted) if accepted else "none (remove `parameters`)"
        problems: list[str] = []
        for err in exc.errors(include_url=False):
            where = location(err["loc"])
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                problems.append(f"unknown parameter {where!r}; accepted parameters: {known}")
            elif err["type"] == "extra_forbidden":
                problems.append(f"unknown key {where!r}; remove it or fix its spelling")
            elif err["type"] == "missing":
                problems.append(f"parameter {where!r} is required")
            else:
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"parameter {where!r}: {message} (got {err.get('input')!r})")
        raise PluginParameterError(plugin_type, name, problems) from exc
