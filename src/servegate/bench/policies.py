"""The routing policies of the standard comparison, as picker configs.

Each policy is an `EndpointPickerConfig` document run by its own gateway:

| policy | plugins (weight) |
|---|---|
| `round-robin` | `round-robin-picker` |
| `load-only` | `queue-scorer` (2), `kv-cache-utilization-scorer` (2), `active-request-scorer` (2) |
| `approx-prefix` | `prefix-cache-scorer` (3, fed by what the gateway routed) + the load scorers |
| `exact-prefix` | `precise-prefix-cache-scorer` (3, fed by the replicas' KV events) + the load scorers |

`exact-prefix` tokenizes prompts with the simulator's tokenizer (the pool's
`tokenizer.source: simulator`) so its block keys match the engines' blocks;
`approx-prefix` hashes characters, as the approximate scorer does without a tokenizer.

A policy whose plugin types the registry lacks is reported as not available
rather than failing the whole comparison, so the comparison grows as plugins land.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

API_VERSION = "llm-d.ai/v1alpha1"
LOAD_SCORERS: tuple[tuple[str, float], ...] = (
    ("queue-scorer", 2.0),
    ("kv-cache-utilization-scorer", 2.0),
    ("active-request-scorer", 2.0),
)


def picker_config(scorers: Sequence[tuple[str, float]], picker: str) -> dict[str, Any]:
    """A one-profile `EndpointPickerConfig` with `scorers` (type, weight) and `picker`."""
    plugins: list[dict[str, Any]] = [{"type": t} for t, _ in scorers]
    plugins.append({"type": picker})
    refs: list[dict[str, Any]] = [{"pluginRef": t, "weight": w} for t, w in scorers]
    refs.append({"pluginRef": picker})
    return {
        "apiVersion": API_VERSION,
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": refs}],
    }


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    scorers: tuple[tuple[str, float], ...]
    picker: str = "max-score-picker"
    kv_events: bool = False
    """The gateway subscribes to the replicas' KV events (endpoint `kv_events` set)."""
    tokenizer: str | None = None
    """The pool's `tokenizer.source`: token ids for routing (None: characters only)."""

    @property
    def picker_config(self) -> dict[str, Any]:
        return picker_config(self.scorers, self.picker)

    @property
    def plugin_types(self) -> tuple[str, ...]:
        return (*(t for t, _ in self.scorers), self.picker)

    @property
    def description(self) -> str:
        """`prefix-cache-scorer ×3 + queue-scorer ×2 → max-score-picker`."""
        scored = " + ".join(f"{t} ×{w:g}" for t, w in self.scorers)
        return f"{scored} → {self.picker}" if scored else self.picker

    def missing(self, registered: Collection[str]) -> list[str]:
        """Plugin types this policy needs that `registered` lacks."""
        return [t for t in self.plugin_types if t not in registered]


STANDARD_POLICIES: tuple[Policy, ...] = (
    Policy("round-robin", (), picker="round-robin-picker"),
    Policy("load-only", LOAD_SCORERS),
    Policy("approx-prefix", (("prefix-cache-scorer", 3.0), *LOAD_SCORERS)),
    Policy(
        "exact-prefix",
        (("precise-prefix-cache-scorer", 3.0), *LOAD_SCORERS),
        kv_events=True,
        tokenizer="simulator",
    ),
)


def policy_named(name: str) -> Policy:
    for policy in STANDARD_POLICIES:
        if policy.name == name:
            return policy
    known = ", ".join(p.name for p in STANDARD_POLICIES)
    raise ValueError(f"unknown policy {name!r}; choose from {known}")


def split_available(
    policies: Sequence[Policy], registered: Collection[str]
) -> tuple[list[Policy], dict[str, str]]:
    """The policies that can run, and for the others why not."""
    runnable: list[Policy] = []
    unavailable: dict[str, str] = {}
    for policy in policies:
        missing = policy.missing(registered)
        if missing:
            types = ", ".join(f"`{t}`" for t in missing)
            unavailable[policy.name] = f"plugin type {types} is not registered in this build"
        else:
            runnable.append(policy)
    return runnable, unavailable


def registered_types() -> Mapping[str, object]:
    from servegate.scheduling.registry import builtin_registry

    return builtin_registry()
