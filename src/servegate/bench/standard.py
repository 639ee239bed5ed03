"""The standard comparison behind `make bench`: routing policies on one simulated cluster.

    .venv/bin/python bench/standard_comparison.py --docs docs/benchmarks.md

Starts `replicas` simulated vLLM replicas (one child process each) with a KV cache
small enough that one replica holds only a few of the workload's shared prefixes
while the cluster holds them all, so routing decides the hit rate. Then one
`servegate serve` process per policy of `policies.STANDARD_POLICIES` (a policy
whose plugins are not registered is listed as not available), and drives the
shared-prefix workload through every gateway in alternating rounds, resetting the
replicas' prefix caches before each segment so no policy inherits another's cache.
The replicas' own counters give the cluster hit rate and the per-replica balance.

Writes the usual report files (`servegate bench`'s: report.md, summary.json/.csv,
requests.csv, ttft_cdf.png) plus the gateways' configs and logs under `out`, and,
with `docs`, rewrites the `standard-comparison` section of that markdown file and
its plot under `img/` beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import typer

from servegate.bench.client import send_request
from servegate.bench.docs_section import update_file
from servegate.bench.engine_counters import engine_url
from servegate.bench.gateway_process import GatewayProcess, GatewayStartError
from servegate.bench.policies import (
    STANDARD_POLICIES,
    Policy,
    policy_named,
    registered_types,
    split_available,
)
from servegate.bench.report import (
    PlotsUnavailable,
    comparison_lines,
    comparisons,
    require_matplotlib,
    rich_progress,
    write_report,
)
from servegate.bench.runner import (
    BenchPlan,
    LoadKind,
    LoadPoint,
    NullProgress,
    ProgressSink,
    SendOptions,
    Target,
    TargetRun,
    run_plan,
)
from servegate.bench.stats import TargetSummary, summarize
from servegate.bench.workloads import Api, BenchRequest, SharedPrefixWorkload

MODEL = "sim-model"
SECTION = "standard-comparison"
DOCS_PLOT = "img/standard-comparison-ttft-cdf.png"
DOCS_SWEEP = "img/standard-comparison-sweep.png"
BASELINE = "round-robin"


@dataclass(frozen=True, slots=True)
class StandardSpec:
    """Cluster, workload and load of the comparison; the defaults are what `make bench` runs."""

    replicas: int = 4
    num_blocks: int = 320
    """KV blocks per replica (block 0 reserved), `block_size` tokens each."""
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 32
    speed: float = 1.0
    """Simulator speed factor (divides every simulated duration)."""
    groups: int = 16
    prompts_per_group: int = 24
    system_prompt_len: int = 512
    """Words; the simulator's tokenizer makes about 1.9 tokens of each made-up word."""
    question_len: int = 32
    output_len: int = 16
    concurrency: tuple[int, ...] = (4, 8, 32)
    """Requests in flight; one load point each, swept in this order."""
    rounds: int = 4
    seed: int = 0
    timeout_s: float = 60.0
    segment_limit_s: float = 300.0
    """No new request starts after this long in one target's share of the run."""

    def __post_init__(self) -> None:
        for spec_field in dataclasses.fields(self):
            value = getattr(self, spec_field.name)
            if spec_field.name == "concurrency":
                if not value or min(value) < 1:
                    raise ValueError(f"concurrency needs values >= 1, got {value}")
            elif spec_field.name != "seed" and value <= 0:
                raise ValueError(f"{spec_field.name} must be > 0, got {value}")
        from servegate.simulator.config import parse_sim_config

        parse_sim_config(self.sim_config())

    @property
    def workload(self) -> SharedPrefixWorkload:
        return SharedPrefixWorkload(
            num_groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            system_prompt_len=self.system_prompt_len,
            question_len=self.question_len,
            output_len=self.output_len,
        )

    def sim_config(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "speed": self.speed,
        }

    def gateway_config(
        self, policy: Policy, urls: Sequence[str], kv_events: Sequence[str | None]
    ) -> dict[str, Any]:
        endpoints: list[dict[str, Any]] = []
        for url, events in zip(urls, kv_events, strict=True):
            endpoint: dict[str, Any] = {"url": url, "model": MODEL}
            if policy.kv_events and events:
                endpoint["kv_events"] = events
            endpoints.append(endpoint)
        pool: dict[str, Any] = {"endpoints": endpoints, "scrape_interval_s": 0.1}
        if policy.tokenizer is not None:
            pool["tokenizer"] = {"source": policy.tokenizer}
        return {
            "gateway": {"host": "127.0.0.1", "port": 0, "seed": self.seed},
            "pool": pool,
            "picker": policy.picker_config,
            "log_level": "info",
        }


DEFAULT_SPEC = StandardSpec()


@dataclass(slots=True)
class StandardResult:
    spec: StandardSpec
    policies: list[Policy]
    unavailable: dict[str, str]
    """Policy name → why it did not run."""
    replica_urls: list[str] = field(default_factory=list)
    runs: list[TargetRun] = field(default_factory=list)
    summaries: list[TargetSummary] = field(default_factory=list)
    wall_s: float = 0.0
    mean_prompt_tokens: float | None = None
    """Prompt tokens per request as the replicas counted them (`usage.prompt_tokens`)."""
    load_average: float = 0.0
    """The machine's 1-minute load average when the run ended."""


async def _warm_up(targets: Sequence[Target], count: int, seed: int) -> None:
    """A few short requests per gateway so connection set-up is not measured."""
    async with aiohttp.ClientSession() as session:
        for target in targets:
            for index in range(count):
                request = BenchRequest(MODEL, 1, prompt=f"warm-up {seed} {target.name} {index}")
                result = await send_request(session, target.url, request, stream=True)
                if not result.ok:
                    raise GatewayStartError(
                        f"warm-up request through {target.name} failed: "
                        f"{result.error_kind} {result.error}"
                    )


async def run_standard(
    spec: StandardSpec,
    out_dir: Path,
    *,
    policies: Sequence[Policy] = STANDARD_POLICIES,
    progress: ProgressSink | None = None,
) -> StandardResult:
    from servegate.testing.cluster import SimClusterProcess

    started = time.perf_counter()
    runnable, unavailable = split_available(policies, registered_types())
    result = StandardResult(spec, runnable, unavailable)
    if not runnable:
        raise ValueError("no policy can run: " + "; ".join(unavailable.values()))
    kv_events: Literal["tcp"] | None = "tcp" if any(p.kv_events for p in runnable) else None
    workdir = out_dir / "gateways"
    async with (
        SimClusterProcess(spec.replicas, base=spec.sim_config(), kv_events=kv_events) as cluster,
        contextlib.AsyncExitStack() as stack,
    ):
        result.replica_urls = list(cluster.urls)
        events = [s.kv_events_endpoint for s in cluster.servers]
        targets = []
        for policy in runnable:
            config = spec.gateway_config(policy, cluster.urls, events)
            gateway = GatewayProcess(
                policy.name, config, workdir, replicas=spec.replicas, startup_timeout_s=120.0
            )
            await stack.enter_async_context(gateway)
            targets.append(Target(policy.name, gateway.url))
        await _warm_up(targets, spec.replicas, spec.seed)
        requests = spec.workload.generate(model=MODEL, api=Api.COMPLETIONS, seed=spec.seed)
        plan = BenchPlan(
            targets=tuple(targets),
            points=tuple(LoadPoint(LoadKind.CONCURRENCY, c) for c in spec.concurrency),
            options=SendOptions(stream=True, ignore_eos=True, timeout_s=spec.timeout_s),
            rounds=spec.rounds,
            max_requests=len(requests),
            duration_s=spec.segment_limit_s * spec.rounds,
            engines=tuple(cluster.urls),
            reset_cache=True,
            isolate_targets=True,
            seed=spec.seed,
        )
        result.runs = await run_plan(plan, requests, progress=progress)
    result.summaries = [summarize(run) for run in result.runs]
    prompt_tokens = [
        r.prompt_tokens for run in result.runs for r in run.results if r.prompt_tokens is not None
    ]
    if prompt_tokens:
        result.mean_prompt_tokens = sum(prompt_tokens) / len(prompt_tokens)
    result.wall_s = time.perf_counter() - started
    result.load_average = os.getloadavg()[0]
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def replica_split(summary: TargetSummary, urls: Sequence[str]) -> str:
    """Requests each replica finished, in the cluster's order: `96 / 95 / 97 / 96`."""
    counts = {engine_url(k): v for k, v in summary.replica_requests.items()}
    if not counts:
        return "-"
    return " / ".join(f"{counts.get(engine_url(u), 0.0):.0f}" for u in urls)


TABLE_COLUMNS = (
    "load",
    "policy",
    "requests",
    "errors",
    "cluster hit rate",
    "balance (max/mean)",
    "requests per replica",
    "TTFT p50",
    "TTFT p99",
    "e2e p50",
    "e2e p99",
    "output tok/s",
)


def comparison_table(result: StandardResult) -> str:
    lines = [
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|",
    ]
    for s in result.summaries:
        balance = "-" if s.balance is None else f"{s.balance:.2f}"
        row = [
            s.load,
            f"`{s.target}`",
            str(s.requests),
            str(s.errors),
            _pct(s.hit_rate),
            balance,
            replica_split(s, result.replica_urls),
            _ms(s.ttft_p50_s),
            _ms(s.ttft_p99_s),
            _ms(s.e2e_p50_s),
            _ms(s.e2e_p99_s),
            f"{s.output_tok_per_s:.0f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    for name in result.unavailable:
        cells = ["", f"`{name}`", "not available", *("" for _ in TABLE_COLUMNS[3:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_lines(result: StandardResult) -> list[str]:
    """Every policy against round-robin (or the first that ran) at each load point, each
    ratio with its 95 % interval over the paired rounds; then the sample warnings."""
    return comparison_lines(comparisons(result.runs, BASELINE))


def render_section(
    result: StandardResult,
    command: str,
    plot: str | None,
    guide: str = "`docs/bench.md`",
    sweep: str | None = None,
) -> str:
    spec = result.spec
    usable = (spec.num_blocks - 1) * spec.block_size
    tokens = (
        f", {result.mean_prompt_tokens:.0f} prompt tokens per request on average"
        if result.mean_prompt_tokens is not None
        else ""
    )
    lines = [
        "## Routing policies on a simulated cluster (`make bench`)",
        "",
        f"`make bench` runs (see {guide} for what it does and its options):",
        "",
        "```",
        command,
        "```",
        "",
        f"{spec.replicas} simulated vLLM replicas (one process each, "
        f"{spec.num_blocks} KV blocks × {spec.block_size} tokens = {usable} cacheable tokens "
        f"each, speed {spec.speed:g}) and one `servegate serve` process per policy. Workload: "
        f"shared-prefix, {spec.groups} groups × {spec.prompts_per_group} questions, system "
        f"prompts of {spec.system_prompt_len} words, questions of {spec.question_len} words"
        f"{tokens}, {spec.output_len} output tokens, streamed; "
        f"{' / '.join(str(c) for c in spec.concurrency)} requests in flight (one load point "
        f"each, the whole workload at each); seed {spec.seed}. At each load point the "
        f"policies take turns over {spec.rounds} rounds (the order rotating each round), and "
        "every replica's prefix cache is reset (`POST /reset_prefix_cache`) before each "
        "turn. Hit rate and balance come from the replicas' own counters "
        "(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, "
        "`vllm:request_success_total`), not from the gateways.",
        "",
        comparison_table(result),
        "",
        "Ratios against `round-robin`: the geometric mean of the per-round ratios, in "
        "brackets the 95 % confidence interval over the rounds (Student's t on the log "
        "ratios); an interval containing 1.00 does not separate the two.",
        "",
        *(f"- {line}" for line in verdict_lines(result)),
    ]
    for name, reason in result.unavailable.items():
        lines.append(f"- `{name}`: not available — {reason}.")
    failed_resets = sum(run.cache_resets_failed for run in result.runs)
    if failed_resets:
        lines.append(
            f"- warning: {failed_resets} prefix-cache resets were refused, so some turns "
            "started with a warm cache"
        )
    lines += [
        "",
        "Policies: "
        + "; ".join(f"`{p.name}` = {p.description}" for p in result.policies)
        + ". Picker configs and gateway logs are written under the run's `gateways/` folder.",
        "",
        f"Whole run (cluster and gateway start-up included): {result.wall_s:.0f} s on "
        f"{os.cpu_count()} CPU cores, load average {result.load_average:.1f} at the end "
        "(other jobs share the machine; compare policies within one run). "
        f"Measured {time.strftime('%Y-%m-%d')}.",
    ]
    if sweep is not None:
        lines += [
            "",
            "Hit rate, balance, TTFT and throughput against concurrency (error bars: 95 % "
            "intervals over the rounds):",
            "",
            f"![hit rate, balance, TTFT and throughput against concurrency]({sweep})",
        ]
    if plot is not None:
        lines += ["", f"![TTFT CDF per policy]({plot})"]
    return "\n".join(lines) + "\n"


def write_outputs(
    result: StandardResult, out_dir: Path, command: str, docs: Path | None
) -> list[Path]:
    meta = {
        "command": command,
        "workload": repr(result.spec.workload),
        "spec": dataclasses.asdict(result.spec),
        "policies": {p.name: p.picker_config for p in result.policies},
        "unavailable": result.unavailable,
        "replicas": result.replica_urls,
        "wall_s": result.wall_s,
        "load_average": result.load_average,
        "mean_prompt_tokens": result.mean_prompt_tokens,
        "cache_resets_failed": sum(run.cache_resets_failed for run in result.runs),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    written = write_report(out_dir, result.runs, result.summaries, meta, baseline=BASELINE)
    section_path = out_dir / "standard-comparison.md"
    local_plot, local_sweep = out_dir / "ttft_cdf.png", out_dir / "sweep.png"
    has_plot, has_sweep = local_plot.exists(), local_sweep.exists()
    section_path.write_text(
        render_section(
            result,
            command,
            "ttft_cdf.png" if has_plot else None,
            sweep="sweep.png" if has_sweep else None,
        )
    )
    written.append(section_path)
    if docs is not None:
        plots: dict[str, str | None] = {DOCS_PLOT: None, DOCS_SWEEP: None}
        for local, name, present in (
            (local_plot, DOCS_PLOT, has_plot),
            (local_sweep, DOCS_SWEEP, has_sweep),
        ):
            if present:
                target = docs.parent / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local, target)
                written.append(target)
                plots[name] = name
        section = render_section(
            result, command, plots[DOCS_PLOT], "[bench.md](bench.md)", sweep=plots[DOCS_SWEEP]
        )
        update_file(docs, SECTION, section)
        written.append(docs)
    return written


def standard_command(
    out: Annotated[Path, typer.Option(help="Directory for the report files.")] = Path(
        "bench/results/standard"
    ),
    docs: Annotated[
        Path | None,
        typer.Option(help="Markdown file whose `standard-comparison` section to rewrite."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Run only these policies (repeatable); default: all four."),
    ] = None,
    replicas: Annotated[int, typer.Option(help="Simulated replicas.")] = DEFAULT_SPEC.replicas,
    num_blocks: Annotated[
        int, typer.Option(help="KV blocks per replica.")
    ] = DEFAULT_SPEC.num_blocks,
    groups: Annotated[int, typer.Option(help="Shared prefixes.")] = DEFAULT_SPEC.groups,
    prompts_per_group: Annotated[
        int, typer.Option(help="Questions per shared prefix.")
    ] = DEFAULT_SPEC.prompts_per_group,
    system_prompt_len: Annotated[
        int, typer.Option(help="Words per shared prefix.")
    ] = DEFAULT_SPEC.system_prompt_len,
    question_len: Annotated[
        int, typer.Option(help="Words per question.")
    ] = DEFAULT_SPEC.question_len,
    output_len: Annotated[
        int, typer.Option(help="Output tokens per request.")
    ] = DEFAULT_SPEC.output_len,
    concurrency: Annotated[
        list[int] | None,
        typer.Option(help="Requests in flight; repeat to sweep (default 4, 8, 32)."),
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="Rounds the policies alternate over.")
    ] = DEFAULT_SPEC.rounds,
    speed: Annotated[float, typer.Option(help="Simulator speed factor.")] = DEFAULT_SPEC.speed,
    seed: Annotated[int, typer.Option(help="Seeds the workload and tie-breaks.")] = 0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.")] = True,
) -> None:
    """Compare routing policies on a simulated cluster; write reports (and refresh docs)."""
    try:
        require_matplotlib()
        spec = StandardSpec(
            replicas=replicas,
            num_blocks=num_blocks,
            groups=groups,
            prompts_per_group=prompts_per_group,
            system_prompt_len=system_prompt_len,
            question_len=question_len,
            output_len=output_len,
            concurrency=tuple(concurrency) if concurrency else DEFAULT_SPEC.concurrency,
            rounds=rounds,
            speed=speed,
            seed=seed,
        )
        chosen = [policy_named(n) for n in policy] if policy else list(STANDARD_POLICIES)
    except (ValueError, PlotsUnavailable) as exc:
        typer.echo(f"standard comparison: {exc}", err=True)
        raise typer.Exit(2) from exc
    from servegate.gateway.server import event_loop_factory

    command = shlex.join(sys.argv)
    if sys.argv[0].endswith(".py"):
        command = "python " + command
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            if progress:
                with rich_progress() as sink:
                    result = runner.run(run_standard(spec, out, policies=chosen, progress=sink))
            else:
                result = runner.run(
                    run_standard(spec, out, policies=chosen, progress=NullProgress())
                )
    except (GatewayStartError, ValueError) as exc:
        typer.echo(f"standard comparison: {exc}", err=True)
        raise typer.Exit(1) from exc
    written = write_outputs(result, out, command, docs)
    typer.echo(comparison_table(result))
    typer.echo("")
    for line in verdict_lines(result):
        typer.echo(line)
    for name, reason in result.unavailable.items():
        typer.echo(f"{name}: not available ({reason})")
    typer.echo(f"\nwall time {result.wall_s:.1f} s; wrote " + ", ".join(map(str, written)))
