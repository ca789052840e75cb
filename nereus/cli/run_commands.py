"""`nereus run`: RL training under a plan on local ranks, and `nereus run --resume`."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nereus.cli.inputs import MAX_LOCAL_RANKS
from nereus.cli.outputs import check_output_folder
from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.runtime.run.run_setup import RunSetup
    from nereus.runtime.run.summary import RunSummary
    from nereus.spec.run_folder import StepMetrics


def describe_step(metrics: StepMetrics) -> str:
    """One line: reward, KL, response length and where the step's time went (every model-stage
    in step order, then the exchanges, the weight sync and a transition before the step)."""
    from nereus.spec.stages import MODEL_STAGES, label

    stages, phases = metrics.model_stage_seconds, metrics.phase_seconds
    shown: list[tuple[str, float]] = [(name, stages[name]) for name in MODEL_STAGES if name in stages]
    shown += [(name, phases[name]) for name in ("exchange", "weight_sync", "transition") if name in phases]
    times = " ".join(f"{label(name)} {seconds:.2f}" for name, seconds in shown)
    score = "" if metrics.score == metrics.reward else f" (rule {metrics.score:.3f})"
    return (
        f"reward {metrics.reward:.3f}{score}  kl {metrics.kl:+.4f}  len {metrics.response_len_mean:.1f}/"
        f"{metrics.response_len_max}  {metrics.step_seconds:.2f}s ({times})"
    )


@contextmanager
def step_progress(setup: RunSetup) -> Iterator[Callable[[StepMetrics], None]]:
    """A rich bar on a terminal (step, reward, KL, length, per-stage times); elsewhere a line per step on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[line]}"),
    )
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("run", total=setup.config.num_steps, completed=setup.start_step, line="starting ranks")

        def on_step(metrics: StepMetrics) -> None:
            bar.update(task, completed=metrics.step + 1, line=describe_step(metrics))
            if not console.is_terminal:
                typer.echo(f"step {metrics.step + 1}/{setup.config.num_steps}  {describe_step(metrics)}", err=True)

        yield on_step


def print_summary(result: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)  # a path on a long line must stay one line to copy it
    console.print(
        f"ran steps {result.first_step + 1}-{result.num_steps} of the run on {result.num_ranks} ranks"
        f" in {result.wall_s} s -> {result.out}"
    )
    if result.reward_first10 is not None and result.reward_last10 is not None:
        console.print(
            f"mean reward: first 10 steps {result.reward_first10:.3f}, last 10 steps {result.reward_last10:.3f}"
            f" ({result.reward_margin:+.3f})"
        )
    if result.mean_step_s is not None:
        table = Table("model-stage", "mean s/step")
        for name, seconds in result.mean_stage_s.items():
            table.add_row(name, f"{seconds:.3f}")
        table.add_row("whole step", f"{result.mean_step_s:.3f}")
        console.print(table)
    console.print(f"last checkpoint: {result.checkpoint}")
    if result.timeline is not None:
        console.print(f"timeline: {result.timeline} (open in ui.perfetto.dev); summary: nereus report {result.out}")


def run(
    config_file: Annotated[
        Path | None,
        typer.Argument(help="RunConfig YAML (e.g. examples/run-ppo.yaml); omit with --resume."),
    ] = None,
    plan_file: Annotated[
        Path | None, typer.Option("--plan", help="Plan YAML; overrides the config's plan (on --resume: reshards).")
    ] = None,
    num_ranks: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            max=MAX_LOCAL_RANKS,
            help="Local ranks to spawn (default: the plan's). On --resume without --plan, "
            "a different count makes the planner lay the run out anew.",
        ),
    ] = None,
    num_steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Total RL steps (overrides the config's num_steps).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run folder (default: runs/CONFIG-DATE-TIME); must be new or empty.")
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue the run in this folder from its last checkpoint."),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Trace YAML of GPU-pool events: the online controller may change the plan."),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option("--policy", help="Controller policy: nereus, fixed, dynarl or periodic:K (default nereus)."),
    ] = None,
    from_previous: Annotated[
        bool,
        typer.Option(
            "--resume-from-previous",
            help="With --resume: when the newest checkpoint is damaged, continue from the newest valid "
            "one (the damaged ones move to DIR/damaged-checkpoints).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run RL post-training under a plan on local ranks (gloo on CPU, NCCL on GPUs)."""
    from nereus.runtime.run.resolve import new_run, resume_run
    from nereus.runtime.run.torchrun import torchrun_worker

    if resume is not None:
        if config_file is not None or out is not None or trace is not None or policy is not None:
            raise NereusError(
                "--resume DIR continues the run in DIR as it was set up: drop CONFIG, --out, --trace, --policy"
            )
    elif from_previous:
        raise NereusError("--resume-from-previous goes with --resume DIR")
    elif config_file is None:
        raise NereusError("give a RunConfig YAML (e.g. examples/run-ppo.yaml) or --resume DIR")
    check_output_folder(out, "--out")
    if torchrun_worker():
        if num_ranks is not None:
            raise NereusError("--nproc: under torchrun the job's ranks are the run's; drop --nproc")
        run_joined(config_file, plan_file, num_steps, out, resume, trace, policy, from_previous, as_json)
        return
    if resume is not None:
        setup = resume_run(resume, plan_file, num_ranks, num_steps, from_previous)
        for folder in setup.damaged:
            typer.echo(f"set aside damaged checkpoint {folder.name} (in {resume}/damaged-checkpoints)", err=True)
    else:
        assert config_file is not None
        setup = new_run(config_file, plan_file, num_ranks, num_steps, out, trace, policy)
    show(launch_with_progress(setup), as_json)


def show(result: RunSummary, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(result), indent=1))
    else:
        print_summary(result)


def run_joined(
    config_file: Path | None,
    plan_file: Path | None,
    num_steps: int | None,
    out: Path | None,
    resume: Path | None,
    trace: Path | None,
    policy: str | None,
    from_previous: bool,
    as_json: bool,
) -> None:
    """`nereus run` as one worker of a torchrun job: rank 0 checks, plans, writes the run
    folder and shows progress; every rank trains its part of the plan."""
    from nereus.runtime.run.joined_job import join_job
    from nereus.runtime.run.torchrun import configured_timeout_s, joined_setup

    job = join_job(configured_timeout_s(config_file, resume))
    setup = job.agree(
        lambda world: joined_setup(world, config_file, plan_file, num_steps, out, resume, trace, policy, from_previous)
    )
    if job.rank != 0:
        job.run(setup)
        return
    for folder in setup.damaged:
        typer.echo(f"set aside damaged checkpoint {folder.name} (in {setup.out}/damaged-checkpoints)", err=True)
    show(launch_with_progress(setup, job.run), as_json)


def launch_with_progress(
    setup: RunSetup, launcher: Callable[[RunSetup, Callable[[StepMetrics], None]], list[StepMetrics]] | None = None
) -> RunSummary:
    """Run `setup` with `launcher` (default: spawn local ranks), showing each step as it lands."""
    from nereus.runtime.run.launch import launch
    from nereus.runtime.run.summary import summarize

    launcher = launch if launcher is None else launcher
    if setup.planned:
        typer.echo(f"planned a new layout for {setup.num_ranks} ranks (see {setup.out}/plan.yaml)", err=True)
    if setup.checkpoint is not None:
        typer.echo(f"resuming from {setup.checkpoint} (step {setup.start_step})", err=True)
    start = time.perf_counter()
    try:
        with step_progress(setup) as on_step:
            records = launcher(setup, on_step)
    except NereusError:
        write_timeline(setup.out)  # what the ranks did before the failure helps find it
        raise
    wall_s = time.perf_counter() - start
    summary = summarize(
        setup.out,
        records,
        wall_s,
        num_ranks=setup.num_ranks,
        first_step=setup.start_step,
        num_steps=setup.config.num_steps,
    )
    return dataclasses.replace(summary, timeline=write_timeline(setup.out))


def write_timeline(out: Path) -> str | None:
    """DIR/timeline.json from the ranks' span logs (Perfetto opens it); None, with a warning,
    when it cannot be written: the run's own results stand either way."""
    from nereus.render.run_timeline import write_run_trace

    try:
        return str(write_run_trace(out))
    except (NereusError, OSError) as error:
        typer.echo(f"warning: no timeline written: {error}", err=True)
        return None


def register(app: typer.Typer) -> None:
    app.command(help="Run RL post-training under a plan on local ranks, or --resume one (checkpoints, metrics.jsonl).")(
        run
    )
