"""`nereus simulate`: replay a drift trace through an adaptation policy (or all of them)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nereus.cli.outputs import check_output
from nereus.cli.progress import progress_bar
from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.solver.simulate import SimulationResult

COMPARED = ("nereus", "fixed", "dynarl", "periodic:3")


def simulate(
    trace_file: Annotated[Path, typer.Argument(help="A Trace file (see `nereus trace generate`).")],
    plan_file: Annotated[Path, typer.Option("--plan", help="The plan the job starts with.")],
    policy: Annotated[str, typer.Option("--policy", help="nereus, fixed, dynarl or periodic:K.")] = "nereus",
    compare: Annotated[
        bool, typer.Option("--compare", help="Run nereus, fixed, dynarl, periodic:3; one table.")
    ] = False,
    noise: Annotated[float, typer.Option("--noise", min=0.0, help="Log-normal sigma of per-step latency noise.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the latency noise.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print results and decisions as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a step-latency plot (PNG, SVG, PDF).")] = None,
    log_file: Annotated[Path | None, typer.Option("--log", help="Write the full decision log (JSON).")] = None,
) -> None:
    """Simulate a run through a drift trace: step latency, decisions, transitions (cost-model results)."""
    from nereus.cli.inputs import load_kind
    from nereus.solver.policy import Replanner, make_policy
    from nereus.solver.simulate import simulate as run
    from nereus.spec.plan import Plan
    from nereus.spec.trace import Trace

    check_output(plot, "--plot")
    if plot is not None and plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise NereusError(f"--plot {plot}: unknown image type {plot.suffix!r}; use .png, .svg or .pdf")
    check_output(log_file, "--log")
    trace = load_kind(str(trace_file), Trace)
    plan = load_kind(str(plan_file), Plan)
    names = COMPARED if compare else (policy,)
    replanner = Replanner(plan)  # type: ignore[arg-type]
    results = []
    for name in names:
        try:
            chosen = make_policy(name, plan, replanner)  # type: ignore[arg-type]
        except ValueError as exc:
            raise NereusError(f"--policy: {exc}") from None
        with progress_bar(f"simulating {name}") as progress:
            results.append(run(trace, chosen, noise=noise, seed=seed, progress=progress))  # type: ignore[arg-type]
    if plot is not None:
        _write_plot(results, plot)
    if log_file is not None:
        _write_log(results, log_file)
    if as_json:
        typer.echo(json.dumps(_payload(results, trace_file, plan_file), indent=2))
    else:
        _print_results(results, trace_file, plot, log_file)


def _write_plot(results: list[SimulationResult], path: Path) -> None:
    from nereus.render.simulate_plot import FORMATS, simulation_plot_bytes
    from nereus.spec.io import write_bytes_atomic

    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise NereusError(f"--plot {path}: unknown image type {path.suffix!r}; use .png, .svg or .pdf")
    write_bytes_atomic(path, simulation_plot_bytes(results, fmt))


def _payload(results: list[SimulationResult], trace_file: Path, plan_file: Path) -> dict[str, Any]:
    return {
        "simulator": "cost-model simulation, not measured",
        "trace": str(trace_file),
        "plan": str(plan_file),
        "results": [{**r.summary(), "decisions": [dataclasses.asdict(d) for d in r.decisions]} for r in results],
    }


def _write_log(results: list[SimulationResult], path: Path) -> None:
    from nereus.solver.policy import record_to_data
    from nereus.spec.io import write_text_atomic

    data = {r.policy: [record_to_data(record) for record in r.log] for r in results}
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def _print_results(results: list[SimulationResult], trace_file: Path, plot: Path | None, log: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120), soft_wrap=True)  # pipes and files: whole table and lines
    overlapped = any(r.num_pipeline_fills for r in results)  # async: the plans overlap generation and training
    mode = "; async: steady state, pipeline refills after each change" if overlapped else ""
    table = Table(title=f"{trace_file} (simulator: cost-model step times{mode})")
    for column in ("policy", "mean step s", "total h", "transitions", "restarts", "stalled", "transition share",
                   "decide ms/step", *(("pipeline fills",) if overlapped else ())):  # fmt: skip
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy, f"{r.mean_step_latency_s:.2f}", f"{r.total_time_s / 3600:.2f}", str(r.num_transitions),
            str(r.num_restarts), str(r.num_stalled), f"{r.transition_share:.3%}", f"{r.mean_decision_time_s * 1e3:.2f}",
            *((str(r.num_pipeline_fills),) if overlapped else ()),
        )  # fmt: skip
    console.print(table)
    if len(results) == 1:
        for d in results[0].decisions:
            if d.action != "keep":
                console.print(f"step {d.step}: {d.action} ({d.path}) {d.reason}", highlight=False)
                if d.target_layout:
                    console.print(f"  -> {d.target_layout}", highlight=False)
    for what, path in (("plot", plot), ("decision log", log)):
        if path is not None:
            console.print(f"wrote {what} {path}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command(help="Replay a drift trace through an adaptation policy (simulator; --compare for all).")(simulate)
