"""Figures from the heavy tests, appended as JSON lines to `$SERVEGATE_RELIABILITY_OUT` when set."""

from __future__ import annotations

import json
import os
from typing import Any


def record_figures(name: str, figures: dict[str, Any]) -> None:
    out = os.environ.get("SERVEGATE_RELIABILITY_OUT")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps({name: figures}) + "\n")
