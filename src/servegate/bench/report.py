"""What a run leaves behind: tables, verdicts, JSON, CSV, plots, and live progress.

`write_report(out_dir, ...)` writes `report.md` (tables, verdicts, plots, command),
`summary.json`, `summary.csv`, `requests.csv` (one row per request) and PNG plots:
`ttft_cdf.png` (TTFT, or end-to-end latency when not streaming, per target; a log time
axis when the tail is over 20 times the fastest) and, for sweeps over more than one
load point, `sweep.png` (latency and throughput versus load).
Plots use matplotlib's object API with the Agg canvas: no pyplot global state, no
display needed. matplotlib is the `bench` extra, not a gateway dependency: it is imported
only when a plot is drawn, and without it `require_matplotlib` says how to install it.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from servegate.bench.client import RequestResult
from servegate.bench.runner import TargetRun
from servegate.bench.stats import (
    RatioEstimate,
    TargetSummary,
    compare_runs,
    round_summaries,
    sample_warnings,
)

SUMMARY_COLUMNS = (
    "target",
    "load",
    "requests",
    "errors",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "e2e p50",
    "e2e p99",
    "hit rate",
    "balance",
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def _row(summary: TargetSummary) -> list[str]:
    hit = _pct(summary.hit_rate)
    if summary.hit_rate_source == "usage":
        hit += " (usage)"
    balance = "-" if summary.balance is None else f"{summary.balance:.2f}"
    return [
        summary.target,
        summary.load,
        str(summary.requests),
        str(summary.errors),
        f"{summary.req_per_s:.2f}",
        f"{summary.output_tok_per_s:.1f}",
        _ms(summary.ttft_p50_s),
        _ms(summary.ttft_p90_s),
        _ms(summary.ttft_p99_s),
        _ms(summary.itl_p50_s),
        _ms(summary.itl_p99_s),
        _ms(summary.e2e_p50_s),
        _ms(summary.e2e_p99_s),
        hit,
        balance,
    ]


def markdown_table(summaries: Sequence[TargetSummary]) -> str:
    lines = [
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "|".join("---" for _ in SUMMARY_COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in summaries]
    return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def verdict(summary: TargetSummary, base: TargetSummary) -> str:
    """One line comparing `summary` with the baseline `base` at the same load point."""
    if summary is base:
        return f"{summary.target}: baseline"
    parts = []
    latency_name, value, reference = "TTFT p50", summary.ttft_p50_s, base.ttft_p50_s
    if value is None or reference is None:
        latency_name, value, reference = "e2e p50", summary.e2e_p50_s, base.e2e_p50_s
    latency = _ratio(value, reference)
    if latency is not None:
        parts.append(f"{latency_name} {latency:.2f}x base")
    throughput = _ratio(summary.output_tok_per_s, base.output_tok_per_s)
    if throughput is None:
        throughput = _ratio(summary.req_per_s, base.req_per_s)
    if throughput is not None:
        parts.append(f"throughput {throughput:.2f}x")
    if summary.hit_rate is not None and base.hit_rate is not None:
        parts.append(f"hit rate {_pct(summary.hit_rate)} vs {_pct(base.hit_rate)}")
    if summary.errors or base.errors:
        parts.append(f"errors {summary.errors} vs {base.errors}")
    return f"{summary.target}: " + (", ".join(parts) if parts else "no comparable numbers")


def group_by_load(summaries: Sequence[TargetSummary]) -> dict[str, list[TargetSummary]]:
    groups: dict[str, list[TargetSummary]] = {}
    for summary in summaries:
        groups.setdefault(summary.load, []).append(summary)
    return groups


def verdicts(summaries: Sequence[TargetSummary]) -> list[str]:
    lines = []
    for load, group in group_by_load(summaries).items():
        lines += [f"[{load}] {verdict(s, group[0])}" for s in group]
    return lines


@dataclass(frozen=True, slots=True)
class Comparison:
    """One target against the baseline at one load point."""

    run: TargetRun
    base: TargetRun
    estimates: list[RatioEstimate]
    warnings: list[str]

    def line(self) -> str:
        parts = ", ".join(e.describe() for e in self.estimates) or "no comparable numbers"
        rounds = max((e.rounds for e in self.estimates), default=0)
        return (
            f"[{self.run.point.label}] {self.run.target.name} vs {self.base.target.name}: "
            f"{parts} ({rounds} rounds; 95 % intervals)"
        )


def comparisons(runs: Sequence[TargetRun], baseline: str | None = None) -> list[Comparison]:
    """Every target against `baseline` (default: the first target) at each load point,
    each ratio with its interval over the paired rounds."""
    by_load: dict[str, list[TargetRun]] = {}
    for run in runs:
        by_load.setdefault(run.point.label, []).append(run)
    out = []
    for group in by_load.values():
        base = next((r for r in group if r.target.name == baseline), group[0])
        for run in group:
            if run is base:
                continue
            estimates = compare_runs(run, base)
            out.append(Comparison(run, base, estimates, sample_warnings(run, base, estimates)))
    return out


def comparison_lines(found: Sequence[Comparison]) -> list[str]:
    """The ratio lines, then every warning once."""
    lines = [c.line() for c in found]
    seen: list[str] = []
    for comparison in found:
        seen += [w for w in comparison.warnings if w not in seen]
    return lines + [f"warning: {w}" for w in seen]


def summary_record(summary: TargetSummary) -> dict[str, Any]:
    return dataclasses.asdict(summary)


def write_json(
    path: Path,
    summaries: Sequence[TargetSummary],
    meta: dict[str, Any],
    found: Sequence[Comparison] = (),
) -> None:
    document = {
        "meta": meta,
        "summaries": [summary_record(s) for s in summaries],
        "ratios": [dataclasses.asdict(e) for c in found for e in c.estimates],
        "warnings": [w for c in found for w in c.warnings],
    }
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def write_summary_csv(path: Path, summaries: Sequence[TargetSummary]) -> None:
    fields = [f.name for f in dataclasses.fields(TargetSummary)]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for summary in summaries:
            record = summary_record(summary)
            for key in ("errors_by_kind", "replica_requests"):
                record[key] = orjson.dumps(record[key]).decode()
            writer.writerow(record)


REQUEST_COLUMNS = (
    "target",
    "load",
    "status",
    "error_kind",
    "e2e_s",
    "ttft_s",
    "itl_mean_s",
    "output_tokens",
    "prompt_tokens",
    "cached_tokens",
    "served_by",
)


def _request_row(run: TargetRun, result: RequestResult) -> list[Any]:
    itl_mean = sum(result.itl_s) / len(result.itl_s) if result.itl_s else None
    return [
        run.target.name,
        run.point.label,
        result.status,
        result.error_kind or "",
        f"{result.e2e_s:.6f}",
        "" if result.ttft_s is None else f"{result.ttft_s:.6f}",
        "" if itl_mean is None else f"{itl_mean:.6f}",
        result.output_tokens,
        "" if result.prompt_tokens is None else result.prompt_tokens,
        "" if result.cached_tokens is None else result.cached_tokens,
        result.served_by or "",
    ]


def write_requests_csv(path: Path, runs: Sequence[TargetRun]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(REQUEST_COLUMNS)
        for run in runs:
            for result in sorted(run.results, key=lambda r: r.started_at):
                writer.writerow(_request_row(run, result))


def _latencies_for_cdf(run: TargetRun) -> tuple[list[float], str]:
    ttfts = [r.ttft_s for r in run.results if r.ok and r.ttft_s is not None]
    if ttfts:
        return ttfts, "TTFT"
    return [r.e2e_s for r in run.results if r.ok], "end-to-end latency"


LOG_SCALE_SPREAD = 20.0
"""A CDF whose slowest value is this many times its fastest gets a log time axis, so
the body of the distribution is not squeezed into a corner by its tail."""


def time_axis_scale(fastest: float, slowest: float) -> str:
    """`log` when the slowest value is over `LOG_SCALE_SPREAD` times the fastest."""
    return "log" if fastest > 0 and slowest > LOG_SCALE_SPREAD * fastest else "linear"


class PlotsUnavailable(RuntimeError):
    """matplotlib (the `bench` extra) is not installed, so no plot can be drawn."""


BENCH_EXTRA_HINT = "pip install 'servegate[bench]'"


def require_matplotlib() -> None:
    """Raise `PlotsUnavailable`, naming the extra to install, when matplotlib is missing;
    the bench command calls it before running so a long run does not end without plots."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # imported earlier but unusable (`sys.modules["matplotlib"] = None`)
        found = False
    if not found:
        raise PlotsUnavailable(
            f"the benchmark's plots need matplotlib, an optional extra: {BENCH_EXTRA_HINT}"
        )


def plot_ttft_cdf(path: Path, runs: Sequence[TargetRun]) -> None:
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    loads: dict[str, list[TargetRun]] = {}
    for run in runs:
        loads.setdefault(run.point.label, []).append(run)
    columns = min(3, len(loads))
    rows = -(-len(loads) // columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for index, (load, group) in enumerate(loads.items()):
        ax = axes[index // columns][index % columns]
        what = "TTFT"
        low, high = math.inf, 0.0
        for run in group:
            values, what = _latencies_for_cdf(run)
            if not values:
                continue
            ordered = sorted(v * 1000 for v in values)
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, fractions, where="post", label=run.target.name)
            low, high = min(low, ordered[0]), max(high, ordered[-1])
        if time_axis_scale(low, high) == "log":
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(f"{what} CDF, {load}")
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    for index in range(len(loads), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.savefig(path, dpi=110)


def _round_interval(run: TargetRun, value: Any) -> tuple[float | None, float | None, float | None]:
    """A metric's mean over `run`'s rounds and its 95 % t-interval (None when absent)."""
    values = [value(s) for s in round_summaries(run).values()]
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    mean = sum(present) / len(present)
    if len(present) < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))
    from servegate.bench.stats import t_critical

    half = t_critical(len(present) - 1) * sd / math.sqrt(len(present))
    return mean, mean - half, mean + half


SWEEP_PANELS: tuple[tuple[str, str, float], ...] = (
    ("hit_rate", "prefix-cache hit rate (%)", 100.0),
    ("balance", "balance (max/mean requests per replica)", 1.0),
    ("ttft", "TTFT p50 (ms); p99 dashed", 1000.0),
    ("output_tok_per_s", "output tokens/s", 1.0),
)


def _panel_value(name: str, summary: TargetSummary) -> float | None:
    if name == "ttft":
        return summary.ttft_p50_s if summary.ttft_p50_s is not None else summary.e2e_p50_s
    value: float | None = getattr(summary, name)
    return value


def plot_sweep(
    path: Path, summaries: Sequence[TargetSummary], runs: Sequence[TargetRun] = ()
) -> None:
    """Hit rate, balance, TTFT and throughput against load, one line per target; error
    bars are 95 % intervals of the per-round values when the runs have rounds."""
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    figure = Figure(figsize=(11.0, 7.5), layout="constrained")
    axes = figure.subplots(2, 2).flatten()
    by_target: dict[str, list[TargetSummary]] = {}
    for summary in summaries:
        by_target.setdefault(summary.target, []).append(summary)
    run_of = {(r.target.name, r.point.label): r for r in runs}
    kind = summaries[0].load_kind if summaries else "load"
    for ax, (name, title, scale) in zip(axes, SWEEP_PANELS, strict=True):
        drawn = False
        for target, points in by_target.items():
            points = sorted(points, key=lambda s: s.load_value)
            xs, ys, errors_low, errors_high = [], [], [], []
            for point in points:
                value = _panel_value(name, point)
                if value is None:
                    continue
                run = run_of.get((target, point.load))
                _, low, high = (
                    _round_interval(run, lambda s, n=name: _panel_value(n, s))
                    if run is not None and len(run.rounds) > 1
                    else (None, None, None)
                )
                xs.append(point.load_value)
                ys.append(value * scale)
                # these quantities are never negative; a wide interval is cut at zero
                low = None if low is None else max(0.0, low)
                errors_low.append(max(0.0, value - low) * scale if low is not None else 0.0)
                errors_high.append(max(0.0, high - value) * scale if high is not None else 0.0)
            if not xs:
                continue
            drawn = True
            line = ax.errorbar(
                xs, ys, yerr=[errors_low, errors_high], marker="o", capsize=3, label=target
            )
            if name == "ttft":
                p99 = [
                    (p.ttft_p99_s if p.ttft_p99_s is not None else p.e2e_p99_s)
                    for p in points
                    if _panel_value(name, p) is not None
                ]
                ax.plot(
                    xs,
                    [(v or 0.0) * scale for v in p99],
                    linestyle="--",
                    marker="x",
                    color=line.lines[0].get_color(),
                )
        unit = "requests/s" if kind == "rate" else kind
        ax.set_xlabel(f"offered load ({unit})")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        loads = sorted({s.load_value for s in summaries})
        if len(loads) > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(loads)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
        if name == "ttft" and drawn:
            positive = [v for line in ax.get_lines() for v in line.get_ydata() if v > 0]
            if positive and time_axis_scale(min(positive), max(positive)) == "log":
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ScalarFormatter())
        elif drawn:
            ax.set_ylim(bottom=0)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    figure.savefig(path, dpi=110)


def render_markdown(
    summaries: Sequence[TargetSummary],
    meta: dict[str, Any],
    plots: Sequence[str],
    found: Sequence[Comparison] = (),
) -> str:
    sections = ["# servegate bench report", ""]
    if meta.get("command"):
        sections += ["```", str(meta["command"]), "```", ""]
    if meta.get("workload"):
        sections += [f"Workload: {meta['workload']}", ""]
    for load, group in group_by_load(summaries).items():
        sections += [f"## {load}", "", markdown_table(group), ""]
        sections += [f"- {verdict(s, group[0])}" for s in group] + [""]
        errors = [s for s in group if s.errors_by_kind]
        for summary in errors:
            kinds = ", ".join(f"{k}: {v}" for k, v in summary.errors_by_kind.items())
            sections.append(f"- errors of {summary.target}: {kinds}")
        for summary in group:
            if summary.engine_scrapes_failed:
                sections.append(
                    f"- {summary.target}: {summary.engine_scrapes_failed} engine /metrics reads "
                    "failed; hit rate and balance leave those segments out"
                )
        if errors or any(s.engine_scrapes_failed for s in group):
            sections.append("")
    if found:
        sections += [
            "## Ratios against the baseline",
            "",
            "Each ratio is the geometric mean of the per-round ratios (every round sends "
            "the same requests to each target), in brackets its 95 % confidence interval "
            "(Student's t on the log ratios). An interval that contains 1.00 does not "
            "separate the two targets.",
            "",
            *(f"- {line}" for line in comparison_lines(found)),
            "",
        ]
    sections += [
        "Times are medians (p50) and tail percentiles over successful requests; rates divide "
        "by each target's own wall time. Hit rate comes from the replicas' prefix-cache "
        "counters, or “(usage)” from `cached_tokens` in responses; balance is max/mean "
        "requests per replica.",
        "",
    ]
    sections += [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(sections).rstrip() + "\n"


def write_report(
    out_dir: Path,
    runs: Sequence[TargetRun],
    summaries: Sequence[TargetSummary],
    meta: dict[str, Any],
    baseline: str | None = None,
) -> list[Path]:
    """Writes every report file into `out_dir` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = comparisons(runs, baseline)
    written = []
    plots = []
    if any(result.ok for run in runs for result in run.results):
        plot_ttft_cdf(out_dir / "ttft_cdf.png", runs)
        plots.append("ttft_cdf.png")
    if len(group_by_load(summaries)) > 1:
        plot_sweep(out_dir / "sweep.png", summaries, runs)
        plots.append("sweep.png")
    written += [out_dir / p for p in plots]
    write_json(out_dir / "summary.json", summaries, meta, found)
    write_summary_csv(out_dir / "summary.csv", summaries)
    write_requests_csv(out_dir / "requests.csv", runs)
    (out_dir / "report.md").write_text(render_markdown(summaries, meta, plots, found))
    written += [out_dir / n for n in ("summary.json", "summary.csv", "requests.csv", "report.md")]
    return written


class RichProgress:
    """A progress bar per segment on stderr, so stdout keeps only the results."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task: TaskID | None = None
        self._errors = 0
        self._description = ""

    def start(self, description: str, total: int) -> None:
        if self._task is not None:
            self._progress.update(self._task, visible=False)
        self._errors = 0
        self._description = description
        self._task = self._progress.add_task(description, total=total)

    def advance(self, result: RequestResult) -> None:
        if self._task is None:
            return
        if not result.ok:
            self._errors += 1
            self._progress.update(
                self._task, description=f"{self._description} [red]{self._errors} errors"
            )
        self._progress.advance(self._task)


@contextmanager
def rich_progress(console: Console | None = None) -> Iterator[RichProgress]:
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        transient=False,
    )
    with progress:
        yield RichProgress(progress)
