"""The standard routing comparison on a simulated cluster; `make bench` runs it.

    .venv/bin/python bench/standard_comparison.py --docs docs/benchmarks.md
    .venv/bin/python bench/standard_comparison.py --policy round-robin --policy approx-prefix

See docs/bench.md; the logic lives in `servegate.bench.standard`.
"""

from __future__ import annotations

import typer

from servegate.bench.standard import standard_command

if __name__ == "__main__":
    typer.run(standard_command)
