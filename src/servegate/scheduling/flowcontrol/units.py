"""Go durations (`200ms`, `1m30s`) and Kubernetes quantities (`1Gi`, `5k`) as llm-d writes them."""

from __future__ import annotations

import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_QUANTITY_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_duration(value: str | float | int) -> float:
    """Seconds from a Go duration string (`"200ms"`, `"1m30s"`, `"0s"`) or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '200ms' or '60s', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration must not be negative, got {value!r}")
        return float(value)
    text = value.strip()
    if text == "0":
        return 0.0
    pos = 0
    total = 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            raise ValueError(
                f"{value!r} is not a duration; write a number with a unit (ns, us, ms, s, m, h), "
                "e.g. '200ms', '60s' or '1m30s'"
            )
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not text:
        raise ValueError("an empty string is not a duration; write e.g. '60s'")
    return total


def parse_quantity(value: str | int) -> int:
    """An integer from a Kubernetes quantity (`"1Gi"`, `"500M"`, `"5k"`, `100`)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a quantity like '1Gi' or 100, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a quantity must not be negative, got {value}")
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(
            f"{value!r} is not a quantity; write an integer with an optional suffix "
            "(k, M, G, T, Ki, Mi, Gi, Ti), e.g. '1Gi' or '5k'"
        )
    return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])
