"""Per-request latency objectives from llm-d's headers.

`x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms` carry the request's time-to-first-token
and time-per-output-token objectives in milliseconds. A missing, empty, unparseable,
non-finite or non-positive value means no objective for that dimension (llm-d logs
a malformed value and goes on without it; so does servegate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TTFT_SLO_HEADER = "x-llm-d-slo-ttft-ms"
TPOT_SLO_HEADER = "x-llm-d-slo-tpot-ms"


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


NO_SLO = Slo()


def _millis(value: str | None) -> float | None:
    if not value:
        return None
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) and parsed > 0.0 else None


def slo_of(headers: Mapping[str, str]) -> Slo:
    """The objectives in lower-cased `headers`."""
    ttft = _millis(headers.get(TTFT_SLO_HEADER))
    tpot = _millis(headers.get(TPOT_SLO_HEADER))
    return NO_SLO if ttft is None and tpot is None else Slo(ttft, tpot)
