"""`servegate bench`: the typer command; registered by `servegate.cli` as `bench`.

    servegate bench --target direct=http://127.0.0.1:8100 --target gw=http://127.0.0.1:8080 \\
        --workload shared-prefix --concurrency 4 --concurrency 16 --out bench/results/run1

Everything it prints and writes comes from `runner.run_plan`, `stats.summarize` and
`report.write_report`; this module only turns options into those calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import orjson
import typer

from servegate.bench.report import (
    PlotsUnavailable,
    comparison_lines,
    comparisons,
    markdown_table,
    require_matplotlib,
    rich_progress,
    write_report,
)
from servegate.bench.runner import (
    BenchPlan,
    LoadKind,
    LoadPoint,
    NullProgress,
    SendOptions,
    Target,
    TargetRun,
    run_plan,
)
from servegate.bench.stats import summarize
from servegate.bench.trace import TraceError, read_trace, write_trace
from servegate.bench.workloads import (
    Api,
    BenchRequest,
    LoraMixWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    Workload,
    with_poisson_timestamps,
)

WORKLOADS = ("shared-prefix", "multi-turn", "lora-mix", "random")


class BenchUsageError(ValueError):
    """Options that do not make a runnable benchmark; the message says what to change."""


def build_workload(
    name: str,
    *,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int | None,
    question_len: int,
    output_len: int,
    sessions: int,
    turns: int,
    adapters: Sequence[str],
    lora_skew: float,
    num_requests: int,
    prompt_len: int,
) -> Workload:
    if name == "shared-prefix":
        return SharedPrefixWorkload(
            num_groups=num_groups,
            prompts_per_group=prompts_per_group,
            system_prompt_len=system_prompt_len or 512,
            question_len=question_len,
            output_len=output_len,
        )
    if name == "multi-turn":
        return MultiTurnWorkload(
            sessions=sessions,
            turns=turns,
            system_prompt_len=system_prompt_len or 128,
            question_len=question_len,
            output_len=output_len,
        )
    if name == "lora-mix":
        if not adapters:
            raise BenchUsageError("--workload lora-mix needs --adapter NAME (repeat for several)")
        return LoraMixWorkload(
            adapters=tuple(adapters),
            skew=lora_skew,
            num_requests=num_requests,
            prompt_len=prompt_len,
            output_len=output_len,
        )
    if name == "random":
        return RandomWorkload(
            num_requests=num_requests, prompt_len=prompt_len, output_len=output_len
        )
    raise BenchUsageError(f"unknown --workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def load_points(
    concurrency: Sequence[int], rate: Sequence[float], trace_speed: float | None
) -> tuple[LoadPoint, ...]:
    given = sum(bool(x) for x in (concurrency, rate, trace_speed is not None))
    if given > 1:
        raise BenchUsageError("choose one load shape: --concurrency, --rate or --trace-speed")
    if trace_speed is not None:
        return (LoadPoint(LoadKind.TRACE, trace_speed),)
    if rate:
        return tuple(LoadPoint(LoadKind.RATE, r) for r in sorted(set(rate)))
    values = sorted(set(concurrency)) or [8]
    return tuple(LoadPoint(LoadKind.CONCURRENCY, c) for c in values)


async def discover_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model a target lists on `/v1/models`."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp,
        ):
            document = orjson.loads(await resp.read()) if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        raise BenchUsageError(
            f"cannot list models at {url}/v1/models ({exc}); pass --model"
        ) from exc
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise BenchUsageError(f"{url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    return factory


def bench_command(
    target: Annotated[
        list[str],
        typer.Option("--target", "-t", help="name=URL of a target; repeat to compare several."),
    ],
    workload: Annotated[
        str, typer.Option(help="shared-prefix | multi-turn | lora-mix | random.")
    ] = "shared-prefix",
    trace: Annotated[
        Path | None, typer.Option(help="Replay this JSONL trace instead of a workload.")
    ] = None,
    save_trace: Annotated[
        Path | None,
        typer.Option(
            help="Write the workload as a trace (untagged; with --rate, Poisson timestamps "
            "at the lowest rate)."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model name; default: the first target's first model.")
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(help="chat | completions; default chat for multi-turn, else completions."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds texts, shuffles and arrivals.")] = 0,
    num_groups: Annotated[int, typer.Option(help="shared-prefix: system prompts.")] = 8,
    prompts_per_group: Annotated[int, typer.Option(help="shared-prefix: questions each.")] = 16,
    system_prompt_len: Annotated[
        int | None, typer.Option(help="Tokens (default 512 shared-prefix, 128 multi-turn).")
    ] = None,
    question_len: Annotated[int, typer.Option(help="Tokens per question.")] = 64,
    output_len: Annotated[int, typer.Option(help="max_tokens per request.")] = 32,
    sessions: Annotated[int, typer.Option(help="multi-turn: conversations.")] = 8,
    turns: Annotated[int, typer.Option(help="multi-turn: turns per conversation.")] = 4,
    adapter: Annotated[
        list[str] | None, typer.Option(help="lora-mix: adapter name, most popular first.")
    ] = None,
    lora_skew: Annotated[float, typer.Option(help="lora-mix: Zipf exponent (0 = uniform).")] = 1.0,
    num_requests: Annotated[int, typer.Option(help="lora-mix and random: requests.")] = 128,
    prompt_len: Annotated[int, typer.Option(help="lora-mix and random: prompt tokens.")] = 256,
    concurrency: Annotated[
        list[int] | None, typer.Option(help="Closed loop with N in flight; repeat to sweep.")
    ] = None,
    rate: Annotated[
        list[float] | None, typer.Option(help="Poisson arrivals, requests/s; repeat to sweep.")
    ] = None,
    trace_speed: Annotated[
        float | None, typer.Option(help="Replay trace timestamps, sped up by this factor.")
    ] = None,
    stream: Annotated[bool, typer.Option(help="Stream responses (needed for TTFT/ITL).")] = True,
    ignore_eos: Annotated[
        bool, typer.Option(help="Send ignore_eos (vLLM) so outputs reach max_tokens.")
    ] = False,
    max_requests: Annotated[int, typer.Option(help="Requests per target and load point.")] = 1000,
    duration: Annotated[
        float, typer.Option(help="Seconds per target and load point (all rounds).")
    ] = 120.0,
    rounds: Annotated[int, typer.Option(help="Alternate targets over this many rounds.")] = 3,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 300.0,
    engine: Annotated[
        list[str] | None,
        typer.Option(help="A replica's base URL, to read its /metrics counters; repeatable."),
    ] = None,
    reset_cache: Annotated[
        bool, typer.Option(help="POST /reset_prefix_cache to every --engine before each run.")
    ] = False,
    isolate_targets: Annotated[
        bool, typer.Option(help="Tag each target's prompts so shared replicas share no prefix.")
    ] = True,
    out: Annotated[Path, typer.Option(help="Directory for the report files.")] = Path(
        "bench/results"
    ),
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.")] = True,
) -> None:
    """Compare targets side by side on one seeded workload; write tables, JSON, CSV, plots."""
    try:
        require_matplotlib()
        targets = tuple(Target.parse(t) for t in target)
        points = load_points(concurrency or [], rate or [], trace_speed)
        plan = BenchPlan(
            targets=targets,
            points=points,
            options=SendOptions(stream=stream, ignore_eos=ignore_eos, timeout_s=timeout),
            rounds=rounds,
            max_requests=max_requests,
            duration_s=duration,
            engines=tuple(engine or ()),
            reset_cache=reset_cache,
            isolate_targets=isolate_targets,
            seed=seed,
        )
        if trace is not None:
            requests = read_trace(trace)
            description = f"trace {trace} ({len(requests)} requests)"
        else:
            spec = build_workload(
                workload,
                num_groups=num_groups,
                prompts_per_group=prompts_per_group,
                system_prompt_len=system_prompt_len,
                question_len=question_len,
                output_len=output_len,
                sessions=sessions,
                turns=turns,
                adapters=adapter or (),
                lora_skew=lora_skew,
                num_requests=num_requests,
                prompt_len=prompt_len,
            )
            chosen_api = (
                Api(api) if api else Api.CHAT if workload == "multi-turn" else Api.COMPLETIONS
            )
            chosen_model = model or (
                "unused" if workload == "lora-mix" else _run(discover_model(targets[0].url))
            )
            requests = spec.generate(model=chosen_model, api=chosen_api, seed=seed)
            description = f"{spec!r}, api={chosen_api}, model={chosen_model}, seed={seed}"
    except (BenchUsageError, TraceError, ValueError, OSError, PlotsUnavailable) as exc:
        typer.echo(f"servegate bench: {exc}", err=True)
        raise typer.Exit(2) from exc
    if save_trace is not None:
        if trace is None and rate:
            requests = with_poisson_timestamps(requests, min(rate), seed)
        write_trace(save_trace, requests)
    runs = _execute(plan, requests, progress)
    _finish(plan, runs, description, out)


def _run(coroutine: Any) -> Any:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coroutine)


def _execute(plan: BenchPlan, requests: list[BenchRequest], show_progress: bool) -> list[TargetRun]:
    if not show_progress:
        result: list[TargetRun] = _run(run_plan(plan, requests, progress=NullProgress()))
        return result
    with rich_progress() as sink:
        result = _run(run_plan(plan, requests, progress=sink))
        return result


def _finish(plan: BenchPlan, runs: list[TargetRun], description: str, out: Path) -> None:
    summaries = [summarize(run) for run in runs]
    meta = {
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "workload": description,
        "targets": {t.name: t.url for t in plan.targets},
        "engines": list(plan.engines),
        "rounds": plan.rounds,
        "stream": plan.options.stream,
        "isolate_targets": plan.isolate_targets,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cache_resets_failed": sum(r.cache_resets_failed for r in runs),
    }
    written = write_report(out, runs, summaries, meta)
    typer.echo(markdown_table(summaries))
    typer.echo("")
    for line in comparison_lines(comparisons(runs)):
        typer.echo(line)
    if meta["cache_resets_failed"]:
        typer.echo(
            f"warning: {meta['cache_resets_failed']} prefix-cache resets were refused "
            "(vLLM needs VLLM_SERVER_DEV_MODE=1)",
            err=True,
        )
    typer.echo("")
    typer.echo("wrote " + ", ".join(str(p) for p in written))
