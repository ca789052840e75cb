"""`nereus report DIR`: a run's step-time breakdown, transitions and prediction error; PNG and Perfetto trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nereus.cli.outputs import check_output

if TYPE_CHECKING:
    from nereus.render.run_report import RunReport


def report(
    folder: Annotated[Path, typer.Argument(help="A run folder (the --out of `nereus run`).")],
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Write a figure: stacked model-stage times per step, transitions, rewards."),
    ] = None,
    perfetto: Annotated[
        Path | None,
        typer.Option("--perfetto", help="Write the whole run's Chrome trace here (open in ui.perfetto.dev)."),
    ] = None,
    first_step: Annotated[
        int, typer.Option("--from-step", min=0, help="Report steps from this one on (e.g. 2: past the warm-up).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Summarise a run: step-time breakdown, transitions and their share, cost-model error per model-stage."""
    from nereus.render.run_report import report_png, since, summarise
    from nereus.render.run_timeline import write_run_trace
    from nereus.spec.io import write_bytes_atomic
    from nereus.spec.run_folder import read_run_folder

    check_output(png, "--png", (".png",))
    check_output(perfetto, "--perfetto", (".json",))
    data = since(read_run_folder(folder), first_step)
    result = summarise(data)
    async_steps = read_async_steps(folder, first_step)
    if perfetto is not None:
        write_run_trace(folder, perfetto)
    if png is not None:
        write_bytes_atomic(png, report_png(data))
    if as_json:
        document = dataclasses.asdict(result)
        if async_steps:
            document["async_steps"] = [dataclasses.asdict(row) for row in async_steps]
        typer.echo(json.dumps(document, indent=1))
    else:
        print_report(result)
        if async_steps:
            print_async_steps(async_steps)
    for option, path in (("figure", png), ("trace", perfetto)):
        if path is not None:
            typer.echo(f"wrote {option} {path}", err=True)


@dataclasses.dataclass(frozen=True)
class AsyncStep:
    """One step of an async run, as its metrics.jsonl record's `async_step` says."""

    step: int
    staleness: dict[int, int]
    """Versions behind the trained weights -> samples of the step's batch."""
    queue_depth: int
    """Samples queued when the step took its batch (the batch included)."""
    generation_busy: float
    """Share of the step the generation pool spent generating."""
    training_busy: float
    """Share of the step the training pool spent on inference and training (not waiting, not syncing)."""
    batch_wait_s: float
    """Seconds the training pool waited for the step's batch."""
    overlap_s: float
    """Seconds the step's generation and training ran at the same time (by their timestamps)."""
    version_spans: dict[int, int]
    """Policy versions a sample's tokens span -> samples of the step's batch (1: one version;
    more only under partial rollout; empty in records from before it was recorded)."""
    continued: int
    """Samples of the batch continued across a weight sync (spanning more than one version)."""


def read_async_steps(folder: Path, first_step: int) -> list[AsyncStep]:
    """Every step's `async_step` record from `first_step` on (empty for a synchronous run);
    a record that is not what the run writes is refused in one line naming the file's line."""
    from nereus.errors import NereusError
    from nereus.spec.run_folder import METRICS_NAME, json_lines

    path = folder / METRICS_NAME
    rows = []
    for where, record in json_lines(path, complete_only=True) if path.is_file() else []:
        data = record.get("async_step")
        if data is None or record.get("step", -1) < first_step:
            continue
        try:
            rows.append(
                AsyncStep(
                    step=int(record["step"]),
                    staleness={int(lag): int(count) for lag, count in dict(data["staleness"]).items()},
                    queue_depth=int(data["queue_depth"]),
                    generation_busy=float(data["generation_busy"]),
                    training_busy=float(data["training_busy"]),
                    batch_wait_s=float(data["batch_wait_s"]),
                    overlap_s=float(data["overlap_s"]),
                    version_spans={int(span): int(n) for span, n in dict(data.get("version_spans", {})).items()},
                    continued=int(data.get("continued", 0)),
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise NereusError(
                f"{where}: async_step: not what an async run writes ({type(error).__name__}: {error}); "
                "fix or delete the line"
            ) from None
    return rows


def print_async_steps(rows: list[AsyncStep]) -> None:
    """The async run's table: each step's staleness histogram, queue depth and busy shares."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "step",
        "staleness (versions: samples)",
        "queue depth",
        "generation busy",
        "training busy",
        "batch wait s",
        "overlap s",
        "continued (spans)",
        title="async: per step",
    )
    for row in rows:
        histogram = "  ".join(f"{lag}: {count}" for lag, count in sorted(row.staleness.items()))
        table.add_row(
            str(row.step),
            histogram,
            str(row.queue_depth),
            f"{100 * row.generation_busy:.0f}%",
            f"{100 * row.training_busy:.0f}%",
            f"{row.batch_wait_s:.3f}",
            f"{row.overlap_s:.3f}",
            f"{row.continued} ({'  '.join(f'{span}: {count}' for span, count in sorted(row.version_spans.items()))})",
        )
    Console(soft_wrap=True).print(table)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_report(result: RunReport) -> None:
    from rich.console import Console
    from rich.table import Table

    from nereus.render.run_report import REWARD_WINDOW
    from nereus.units import format_bytes

    console = Console(soft_wrap=True)
    window = min(REWARD_WINDOW, result.num_steps)
    from_step = f" (from step {result.first_step})" if result.first_step else ""
    steps = f"{result.num_steps} steps{from_step} in {result.run_s:.2f} s"
    mean, median = f"{result.mean_step_s:.3f}", f"{result.median_step_s:.3f}"
    console.print(f"{result.folder}: {steps}; step mean {mean} s, median {median} s")
    first, last = f"{result.reward_first:.3f}", f"{result.reward_last:.3f}"
    if result.num_steps > REWARD_WINDOW:
        console.print(f"mean reward: first {window} steps {first}, last {window} {last}")
    else:  # the two windows are the same steps
        console.print(f"mean reward: {first} over the {result.num_steps} steps")
    stages = Table("model-stage / phase", "mean s/step", "share of step", title="where a step's time goes")
    for stage in result.stages:
        stages.add_row(stage.name, f"{stage.mean_s:.3f}", f"{100 * stage.share:.1f}%")
    other_share = result.other_s / result.mean_step_s if result.mean_step_s > 0 else 0.0
    stages.add_row("(other)", f"{result.other_s:.3f}", f"{100 * other_share:.1f}%")
    console.print(stages)
    if result.other_s < 0:
        console.print("(each part is timed on its own slowest rank, so the parts can add up to more than the step)")
    console.print(
        f"transitions: {len(result.transitions)}, {result.transition_s:.2f} s,"
        f" {100 * result.transition_share:.1f}% of run time"
    )
    if result.transitions:
        moves = Table("before step", "action", "measured s", "predicted s", "primitives")
        for move in result.transitions:
            primitives = "-" if move.num_primitives is None else str(move.num_primitives)
            moves.add_row(
                str(move.step), move.action, _seconds(move.measured_s), _seconds(move.predicted_s), primitives
            )
        console.print(moves)
    if result.prediction_errors:
        errors = Table("model-stage", "steps", "mean predicted s", "mean measured s", "MAPE", title="cost model")
        for error in result.prediction_errors:
            errors.add_row(
                error.name,
                str(error.num_steps),
                f"{error.mean_predicted_s:.3f}",
                f"{error.mean_measured_s:.3f}",
                f"{error.mape_percent:.1f}%",
            )
        console.print(errors)
        if result.not_compared:
            console.print(f"not compared (no model runs them: reward: rule): {', '.join(result.not_compared)}")
    else:
        console.print("cost model: no predictions recorded in metrics.jsonl (runs before predictions were logged)")
    if result.memory:
        table = Table("model-stage", "measured peak", "predicted peak", "error", title="peak memory (fullest rank)")
        for row in result.memory:
            table.add_row(
                row.name,
                format_bytes(row.measured_bytes),
                format_bytes(row.predicted_bytes),
                f"{row.error_percent:+.1f}%",
            )
        console.print(table)
    if result.decisions:
        counts = ", ".join(f"{action} {count}" for action, count in sorted(result.decisions.items()))
        refused = f" ({result.num_refused} refused by the runtime)" if result.num_refused else ""
        console.print(f"controller decisions: {counts}{refused}")


def register(app: typer.Typer) -> None:
    app.command(help="Summarise a run folder (step-time breakdown, transitions, prediction error); PNG, Perfetto.")(
        report
    )
