"""Bar chart of `bench_real_peers.py`'s table: fraction of the oracle's hit rate per workload.

    .venv-engine/bin/python bench/plot_real_peers.py run.log docs/img/real-peers.png

Reads the rows `| workload | `target` | hit % | of oracle | … | max/mean | …` from the
bench's output (the last row per workload and target wins) and needs matplotlib
(the engine venv has it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROW = re.compile(r"^\| (\S+) \| `([^`]+)` \| ([\d.]+) % \| [^|]+\| [^|]+\| ([\d.]+) \|")


def read(path: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """workload → target → (hit rate, max/mean)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        match = ROW.match(line)
        if match:
            workload, target, rate, imbalance = match.groups()
            out.setdefault(workload, {})[target] = (float(rate), float(imbalance))
    return out


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read(Path(argv[0]))
    order = ["round-robin", "vllm-router", "sglang-router", "servegate", "servegate-sticky"]
    seen = {t for row in data.values() for t in row}
    targets = [t for t in order if t in seen]
    workloads = [w for w in data if "oracle" in data[w]]
    fig, ax = plt.subplots(figsize=(max(8, len(workloads) * 1.3), 3.6))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        values = [
            data[w][target][0] / data[w]["oracle"][0] if target in data[w] else 0.0
            for w in workloads
        ]
        xs = [j + (i - (len(targets) - 1) / 2) * width for j in range(len(workloads))]
        bars = ax.bar(xs, values, width, label=target)
        for x, v, w in zip(xs, values, workloads, strict=True):
            if target in data[w]:
                ax.text(x, v + 0.01, f"{data[w][target][1]:.2f}", ha="center", fontsize=6)
        _ = bars
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads, fontsize=7)
    ax.set_ylabel("hit rate / oracle's")
    ax.set_ylim(0, 1.15)
    ax.set_title("3 real vLLM servers (CPU), nothing configured; labels: max/mean requests")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
