"""`nereus schedule fuse` and `nereus schedule migrate`: the two fusions of RLHFuse."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nereus.cli.outputs import check_output
from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.cost.calibration import Calibration
    from nereus.solver.migration import SweepResult
    from nereus.solver.pipeline.model import ModelTimes
    from nereus.spec.plan import Plan
    from nereus.spec.schedule import ExactMemorySummary, Schedule

schedule_app = typer.Typer(help="Fused pipeline schedules and long-tail migration.", no_args_is_help=True)


def _pair(option: str, text: str | None, cast: type) -> tuple[Any, Any] | None:
    """`8,4` -> (8, 4): actor first, then critic."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(cast(p) for p in parts)
    except ValueError:
        raise NereusError(f"{option}: expected two {cast.__name__} values `ACTOR,CRITIC`, got {text!r}") from None
    if len(values) != 2:
        raise NereusError(f"{option}: expected two values `ACTOR,CRITIC` (actor first), got {len(values)}")
    return values


def _explicit_models(
    stages: str | None, microbatches: str | None, fwd: str | None, bwd: str | None, act: str | None
) -> tuple[ModelTimes, ModelTimes]:
    from nereus.solver.pipeline.model import ModelTimes

    given = {
        "--stages": _pair("--stages", stages, int),
        "--microbatches": _pair("--microbatches", microbatches, int),
        "--fwd": _pair("--fwd", fwd, float),
        "--bwd": _pair("--bwd", bwd, float),
    }
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise NereusError(
            f"give --plan PLAN.yaml, or all of --stages, --microbatches, --fwd, --bwd (missing {', '.join(missing)})"
        )
    activation = _pair("--act", act, float) or (1.0, 1.0)
    out = []
    for i, name in enumerate(("actor", "critic")):
        s, m, f, b = (given[k][i] for k in given)  # type: ignore[index]
        if s < 1 or m < 1 or not f > 0 or not b > 0 or activation[i] < 0:
            raise NereusError(f"{name}: stages and micro-batches must be >= 1, times > 0 and --act >= 0")
        out.append(ModelTimes.uniform(name, s, m, f, b, activation[i]))
    return out[0], out[1]


@schedule_app.command("fuse")
def fuse(
    plan: Annotated[
        Path | None, typer.Option("--plan", help="Take actor/critic training layouts and times from this Plan.")
    ] = None,
    stages: Annotated[str | None, typer.Option("--stages", help="Pipeline stages ACTOR,CRITIC, e.g. 8,4.")] = None,
    microbatches: Annotated[
        str | None, typer.Option("--microbatches", help="Micro-batches per model ACTOR,CRITIC.")
    ] = None,
    fwd: Annotated[str | None, typer.Option("--fwd", help="Forward time per stage ACTOR,CRITIC.")] = None,
    bwd: Annotated[str | None, typer.Option("--bwd", help="Backward time per stage ACTOR,CRITIC.")] = None,
    act: Annotated[
        str | None, typer.Option("--act", help="Activation per in-flight micro-batch ACTOR,CRITIC (default 1,1).")
    ] = None,
    act_cap: Annotated[
        float | None,
        typer.Option(
            "--act-cap", min=0.0, help="Per-node activation cap (--plan: default = GiB left after model states)."
        ),
    ] = None,
    p2p_latency: Annotated[
        float, typer.Option("--p2p-latency", min=0.0, help="Latency added to each cross-node edge.")
    ] = 0.0,
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            min=0.01,
            help="Search seconds in all: bounds and starts, annealing (all seeds together), then CP-SAT peak windows.",
        ),
    ] = 10.0,
    window_share: Annotated[
        float | None,
        typer.Option(
            "--window-share",
            min=0.0,
            max=0.99,
            help="Share of --time-limit for the CP-SAT windows that lower the peak at the makespan found "
            "(0: annealing only; default: the search's own share; needs OR-Tools).",
        ),
    ] = None,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Annealing seeds, run in parallel processes.")] = 2,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Also solve with CP-SAT (small instances): the fastest schedule, and the least peak at this makespan.",
        ),
    ] = False,
    exact_time_limit: Annotated[
        float, typer.Option("--exact-time-limit", min=0.1, help="Seconds for each of the two CP-SAT solves.")
    ] = 30.0,
    calibration: Annotated[
        Path | None, typer.Option("--calibration", help="Calibration file for --plan times.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Schedule document as JSON.")] = False,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the Schedule document (YAML, or JSON by suffix).")
    ] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="Draw the per-node timeline here (.png or .svg).")
    ] = None,
    perfetto: Annotated[
        Path | None, typer.Option("--perfetto", help="Write a Chrome/Perfetto trace here (.json).")
    ] = None,
) -> None:
    """Search the fused actor-critic pipeline schedule and compare it with bounds and baselines.

    Actor stages run on nodes 0..N-1 and critic stages the other way; the model with fewer
    stages runs as replicas. Either --plan, or the explicit form with --stages,
    --microbatches, --fwd, --bwd (and --act), each ACTOR,CRITIC.
    """
    from nereus.solver.pipeline.document import to_document
    from nereus.solver.pipeline.search import SearchConfig, search_fused
    from nereus.spec.io import save_document, to_json, write_bytes_atomic, write_text_atomic

    check_output(output, "-o", (".yaml", ".yml", ".json"))
    for flag, value in (("--act-cap", act_cap), ("--p2p-latency", p2p_latency), ("--time-limit", time_limit)):
        if value is not None and not math.isfinite(value):
            raise NereusError(f"{flag} {value}: not a finite number; give a finite one or leave the option out")
    check_output(gantt, "--gantt", (".png", ".svg"))
    check_output(perfetto, "--perfetto", (".json",))
    config = SearchConfig(time_limit_s=time_limit, seeds=seeds)
    if window_share is not None:
        config = replace(config, window_share=window_share)
    if plan is not None:
        if any(v is not None for v in (stages, microbatches, fwd, bwd, act)):
            raise NereusError("--plan takes the times from the plan; drop --stages/--microbatches/--fwd/--bwd/--act")
        from nereus.runtime.model.fused_schedule import fused_pipelines

        pipelines, act_cap = fused_pipelines(*_plan_and_calibration(plan, calibration), act_cap, str(plan))
        actor, critic = pipelines.actor, pipelines.critic
        units = ("s", "GiB")
    else:
        if calibration is not None:
            raise NereusError("--calibration only applies with --plan")
        actor, critic = _explicit_models(stages, microbatches, fwd, bwd, act)
        units = ("", "")
    with _progress(f"annealing {seeds} seed(s) for {time_limit:g} s", seeds) as report:
        result = search_fused(actor, critic, config, p2p_latency, act_cap, report)
    exact_result = exact_memory = None
    if exact:
        from nereus.solver.pipeline.exact import solve_exact, solve_memory_at

        exact_result = solve_exact(result.instance, exact_time_limit)
        exact_memory = solve_memory_at(result.instance, result.orders, exact_time_limit)
    document = to_document(result, exact_result, *units, exact_memory=exact_memory)
    if output:
        save_document(document, output)
    if gantt:
        from nereus.render.schedule_gantt import schedule_gantt

        data = schedule_gantt(document, gantt.suffix.lower().lstrip("."))
        write_bytes_atomic(gantt, data)
    if perfetto:
        from nereus.render.schedule_perfetto import schedule_trace

        write_text_atomic(perfetto, schedule_trace(document) + "\n")
    if as_json:
        typer.echo(to_json(document))
    else:
        _print_fuse(document, result.greedy_rule, [p for p in (output, gantt, perfetto) if p])


def _plan_and_calibration(path: Path, calibration: Path | None) -> tuple[Plan, Calibration]:
    from nereus.cli.inputs import load_kind
    from nereus.cost.calibration import Calibration
    from nereus.spec.plan import Plan

    the_plan = load_kind(str(path), Plan)
    the_calibration = load_kind(str(calibration), Calibration) if calibration else Calibration()
    return the_plan, the_calibration  # type: ignore[return-value]


class _progress:
    """A rich progress bar on a terminal's stderr; silent otherwise."""

    def __init__(self, title: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import Progress

        console = Console(stderr=True)
        self.bar = Progress(console=console, transient=True) if console.is_terminal else None
        self.title, self.total = title, total

    def __enter__(self) -> Any:
        if self.bar is None:
            return None
        self.bar.start()
        task = self.bar.add_task(self.title, total=self.total)
        bar = self.bar
        return lambda done, total: bar.update(task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _print_fuse(document: Schedule, greedy_rule: str, written: list[Path]) -> None:
    from rich.console import Console

    s = document.summary
    t = f" {document.time_unit}" if document.time_unit else ""
    mem = f" {document.memory_unit}" if document.memory_unit else ""
    models = ", ".join(
        f"{m.name} {len(m.forward)} stages x {len(m.replica_nodes)} replica(s), {m.microbatches} micro-batches"
        for m in document.models
    )
    console = Console(width=120, highlight=False, soft_wrap=True)
    console.print(f"fused schedule on {document.num_nodes} nodes: {models}", markup=False)
    reached = "lower bound reached" if s.gap <= 1e-9 else f"gap {100 * s.gap:.1f}%"
    console.print(f"makespan: {s.makespan:.6g}{t} (lower bound {s.lower_bound:.6g}{t}, {reached})", markup=False)
    ratio = s.peak_memory / s.memory_bound if s.memory_bound else 1.0
    floor = "" if s.memory_lower_bound is None else f", lower bound at this makespan {s.memory_lower_bound:.4g}{mem}"
    console.print(
        f"peak activation: {s.peak_memory:.4g}{mem} per node (memory bound {s.memory_bound:.4g}{mem}, "
        f"{ratio:.2f}x{floor})",
        markup=False,
    )
    for lean in s.lean_alternatives:  # the trade-off: what holding less costs in makespan
        cost = 100 * (lean.makespan / s.makespan - 1) if s.makespan else 0.0
        console.print(
            f"leaner: peak {lean.peak_memory:.4g}{mem} ({lean.peak_memory / (s.memory_bound or 1.0):.2f}x) "
            f"at makespan {lean.makespan:.6g}{t} (+{cost:.2f}%), --act-cap {lean.activation_cap:.4g}",
            markup=False,
        )
    console.print(f"bubble ratio: {100 * s.bubble_ratio:.1f}%", markup=False)
    console.print(
        f"speedup: {s.speedup_vs_serial:.3f}x vs serial 1F1B ({s.serial_1f1b_makespan:.6g}{t}), "
        f"{s.serial_chimera_makespan / s.makespan:.3f}x vs serial Chimera-style ({s.serial_chimera_makespan:.6g}{t})",
        markup=False,
    )
    console.print(f"greedy start: {s.greedy_makespan:.6g}{t} ({greedy_rule})", markup=False)
    console.print(f"search: {s.search_s:.2f} s, {s.seeds} seed(s)", markup=False)
    if s.exact is not None:
        e = s.exact
        line = f"exact CP-SAT: {e.status}"
        if e.makespan is not None:
            match = (
                "heuristic matches it"
                if s.makespan <= e.makespan * (1 + 1e-9)
                else f"heuristic {100 * (s.makespan / e.makespan - 1):.1f}% longer"
            )
            line += f", makespan {e.makespan:.6g}{t} ({match}), bound {e.bound:.6g}, peak {e.peak_memory:.4g}{mem}"
            line += " (memory optimal)" if e.memory_optimal else ""
        console.print(line + f", {e.wall_s:.2f} s", markup=False)
    if s.exact_memory is not None:
        _print_exact_memory(console, s.exact_memory, s.peak_memory, mem)
    for path in written:
        console.print(f"wrote {path}", markup=False)


def _print_exact_memory(console: Any, e: ExactMemorySummary, peak: float, mem: str) -> None:
    line = f"exact CP-SAT memory at this makespan: {e.status}"
    if e.peak_memory is not None:
        match = (
            "heuristic matches it"
            if peak <= e.peak_memory * (1 + 1e-9)
            else f"heuristic {100 * (peak / e.peak_memory - 1):.1f}% higher"
        )
        line += f", peak {e.peak_memory:.4g}{mem} ({match}), bound {e.bound or 0:.4g}{mem}"
    console.print(line + f", {e.wall_s:.2f} s", markup=False)


@schedule_app.command("migrate")
def migrate(
    plan: Annotated[Path, typer.Option("--plan", help="Plan whose actor/generation layout and workload to simulate.")],
    num_batches: Annotated[
        int, typer.Option("--batches", min=1, help="Sampled batches the threshold is averaged over.")
    ] = 4,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the sampled response lengths.")] = 0,
    calibration: Annotated[
        Path | None, typer.Option("--calibration", help="Calibration file for the cost model.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Simulate generation with long-tail migration; sweep the threshold 5%..95%; report the best."""
    from nereus.cli.inputs import load_kind
    from nereus.cost.calibration import Calibration
    from nereus.solver.migration import generation_profile, sweep_thresholds
    from nereus.spec.plan import Plan

    the_plan = load_kind(str(plan), Plan)
    the_calibration = load_kind(str(calibration), Calibration) if calibration else Calibration()
    profile = generation_profile(the_plan, the_calibration)  # type: ignore[arg-type]
    with _progress("sweeping thresholds", 1) as report:
        result = sweep_thresholds(profile, num_batches=num_batches, seed=seed, progress=report)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_migrate(result)


def _print_migrate(result: SweepResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120, highlight=False, soft_wrap=True)
    p = result.profile
    console.print(
        f"generation: {p.num_instances} instances x {p.samples_per_instance} samples, lengths median "
        f"{p.lengths.median} / p99 {p.lengths.p99} / max {p.lengths.max} tokens",
        markup=False,
    )
    table = Table(title_justify="left")
    for column in ("threshold", "gen+inf (s)", "speedup", "destinations", "mechanism"):
        table.add_column(column, justify="right")
    for point in result.points:
        mark = " *" if point is result.best else ""
        speedup = result.baseline_s / point.total_s
        cells = (f"{100 * point.threshold:.0f}%{mark}", f"{point.total_s:.3f}", f"{speedup:.3f}x")
        table.add_row(*cells, f"{point.destinations:.1f}", point.mechanism)
    console.print(table)
    b = result.best
    console.print(
        f"without fusion: generation {result.baseline_generation_s:.3f} s + inference "
        f"{result.baseline_inference_s:.3f} s = {result.baseline_s:.3f} s",
        markup=False,
    )
    console.print(
        f"with fusion: {b.total_s:.3f} s at threshold {100 * b.threshold:.0f}% of the batch "
        f"({result.baseline_s / b.total_s:.3f}x; {b.destinations:.1f} destination instances, {b.mechanism})",
        markup=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(
        schedule_app,
        name="schedule",
        help="Fused pipeline schedules (`schedule fuse`) and long-tail migration (`schedule migrate`).",
    )
