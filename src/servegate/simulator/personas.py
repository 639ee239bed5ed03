"""What differs between the engines the simulator can pose as: paths, ports, errors.

The engine, the KV cache and the scheduling are the same for every persona;
only the outside changes (see PROTOCOLS.md sections 1 and 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ErrorStyle = Literal["nested", "flat", "triton"]


@dataclass(frozen=True, slots=True)
class PersonaSpec:
    name: str
    openai: bool
    """Serves the OpenAI routes (`/v1/...`)."""
    metrics_path: str
    health_path: str
    metrics_on_own_port: bool
    error_style: ErrorStyle
    """`nested`: vLLM's `{"error": {...}}`; `flat`: `{"object": "error", ...}`
    (SGLang, trtllm-serve, older vLLM); `triton`: `{"error": "message"}`."""
    owned_by: str
    default_metrics_port: int | None = None


PERSONA_SPECS: dict[str, PersonaSpec] = {
    "vllm": PersonaSpec("vllm", True, "/metrics", "/health", False, "nested", "vllm"),
    "sglang": PersonaSpec("sglang", True, "/metrics", "/health", False, "flat", "sglang"),
    "trtllm-serve": PersonaSpec(
        "trtllm-serve", True, "/prometheus/metrics", "/health", False, "flat", "tensorrt_llm"
    ),
    "triton-tensorrt-llm": PersonaSpec(
        "triton-tensorrt-llm", False, "/metrics", "/v2/health/ready", True, "triton", "triton", 8002
    ),
}


def persona_spec(name: str) -> PersonaSpec:
    return PERSONA_SPECS[name]
