"""The prefill/decode EndpointPickerConfig the disaggregation tests build on."""

from __future__ import annotations

from typing import Any

PD_HANDLER = {
    "type": "disagg-profile-handler",
    "parameters": {"deciders": {"prefill": "always-disagg-pd-decider"}},
}
"""Every request goes through prefill, then decode."""


def disagg_picker(
    handler: dict[str, Any], extra: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "always-disagg-pd-decider"},
            *(extra or []),
            handler,
        ],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]},
        ],
    }
