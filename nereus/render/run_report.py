"""A finished (or running) `nereus run` folder, read back and summarised: `nereus report DIR`.

`nereus.spec.run_folder.read_run_folder` parses the folder's files into typed records
(metrics.jsonl, decisions.jsonl, timeline/rank-R.jsonl); `summarise` turns them into a
`RunReport` (step-time breakdown, transitions and their share of the run, cost-model error
per model-stage, rewards, decisions by action); `report_png` draws the per-step figure.
Nothing here imports torch or the runtime; matplotlib only inside `report_png`.

Run time is the sum of the steps' wall times plus the transitions' (a step's `step_seconds`
excludes the plan change before it, which metrics record as `transition` or `restart`).
"""

from __future__ import annotations

import io
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.errors import ArgumentError
from nereus.render import new_figure
from nereus.spec.run_folder import (
    CHECKPOINTS_NAME,
    PLAN_NAME,
    RunFolder,
    Span,
    StepRecord,
    read_run_folder,
    switch_plan_name,
)
from nereus.spec.stages import PLAN_CHANGES, is_model_stage, role_of

#: Steps averaged for the first and last reward.
REWARD_WINDOW = 10


def since(data: RunFolder, first_step: int) -> RunFolder:
    """The run from step `first_step` on (e.g. past the warm-up steps); one line if none is left."""
    steps = [record for record in data.steps if record.step >= first_step]
    if not steps:
        last = max((record.step for record in data.steps), default=-1)
        raise ArgumentError(
            f"`first_step` {first_step}: {data.folder} has steps 0-{last}; pick one of them", "first_step"
        )
    decisions = [decision for decision in data.decisions if decision.step >= first_step]
    spans = [span for span in data.spans if span.step >= first_step]
    return RunFolder(data.folder, data.config, steps, decisions, spans)


def plan_pools(folder: Path, steps: list[StepRecord]) -> dict[int, dict[str, str]]:
    """model-stage -> pool of every plan index whose plan the folder still holds: plan.yaml for
    the first, a configured switch's plan file from its step, a checkpoint's plan for the plan
    in force at the step before it."""
    from nereus.spec.io import load_document
    from nereus.spec.plan import Plan

    index_at = {record.step: record.plan_index for record in steps}
    candidates: list[tuple[int | None, Path]] = [(index_at.get(0, 0), folder / PLAN_NAME)]
    candidates += [(index_at.get(r.step), folder / switch_plan_name(r.step)) for r in steps]
    for checkpoint in sorted((folder / CHECKPOINTS_NAME).glob("step-*")):
        step = int(checkpoint.name.removeprefix("step-")) if checkpoint.name[5:].isdigit() else -1
        candidates.append((index_at.get(step - 1), checkpoint / PLAN_NAME))
    pools: dict[int, dict[str, str]] = {}
    for index, path in candidates:
        if index is None or index in pools or not path.is_file():
            continue
        plan = load_document(path)
        if isinstance(plan, Plan):
            pools[index] = {entry.model_stage: entry.pool for entry in plan.stages}
    return pools


# ---------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class StageTime:
    """Mean seconds per step of one model-stage or phase (0 in steps without it)."""

    name: str
    mean_s: float
    share: float
    """Of the mean step time."""


@dataclass(frozen=True)
class TransitionTime:
    """One plan change: measured (slowest rank) against the cost model's prediction."""

    step: int
    """The step it ran before."""
    action: str
    """transition (live, through the DAG) or restart (through a checkpoint)."""
    measured_s: float
    predicted_s: float | None
    num_primitives: int | None


@dataclass(frozen=True)
class PredictionError:
    """Mean absolute percentage error of the cost model's prediction against the measurement."""

    name: str
    """A model-stage, or `step` for the whole step."""
    mape_percent: float
    num_steps: int
    """Steps where both exist."""
    mean_predicted_s: float
    mean_measured_s: float


@dataclass(frozen=True)
class StageMemory:
    """Peak memory of one model-stage on its fullest rank: measured against predicted."""

    name: str
    measured_bytes: int
    """Largest measured peak over its ranks and the reported steps."""
    predicted_bytes: int
    """Largest predicted peak over its ranks and the reported steps."""
    error_percent: float
    """(measured - predicted) / predicted, in percent."""


@dataclass(frozen=True)
class RunReport:
    """What `nereus report DIR` shows (and prints as JSON)."""

    folder: str
    first_step: int
    """The first step reported (later than 0 when asked to skip the warm-up)."""
    num_steps: int
    """Finished steps in metrics.jsonl from first_step on."""
    run_s: float
    """Sum of step times and transition times."""
    mean_step_s: float
    median_step_s: float
    stages: list[StageTime]
    """Model-stages and phases, in the order the run records them."""
    other_s: float
    """Mean step time outside every recorded model-stage and phase (sampling, scoring, bookkeeping)."""
    transitions: list[TransitionTime]
    transition_s: float
    transition_share: float
    """Of run_s."""
    prediction_errors: list[PredictionError]
    not_compared: list[str]
    """Predicted model-stages the run runs without a model (reward/inference under `reward:
    rule`): their measured time is the rule's, nothing the prediction describes."""
    reward_first: float
    """Mean reward of the first REWARD_WINDOW steps."""
    reward_last: float
    decisions: dict[str, int]
    """Controller decisions by action (runs with --trace)."""
    num_refused: int
    """Decisions whose target plan the runtime refused (the plan was kept)."""
    num_spans: int
    """Timeline spans over all ranks (0: the run wrote no timeline)."""
    memory: list[StageMemory] = field(default_factory=list)
    """Per model-stage peak memory, measured and predicted (runs that recorded both)."""


def _mean_stage_times(steps: list[StepRecord], mean_step: float) -> list[StageTime]:
    names = list(dict.fromkeys(name for r in steps for name in r.stage_seconds if name not in PLAN_CHANGES))
    stages = []
    for name in names:
        mean = statistics.mean(r.stage_seconds.get(name, 0.0) for r in steps)
        stages.append(StageTime(name, mean, mean / mean_step if mean_step > 0 else 0.0))
    return stages


def move_spans(spans: list[Span]) -> dict[int, Span]:
    """The plan change before each step: its earliest `transition` span over the ranks that
    carries the prediction (spans nested in it, e.g. building engines, carry none)."""
    moves: dict[int, Span] = {}
    for span in spans:  # sorted by start
        if span.cat == "transition" and "predicted_s" in span.args and span.step not in moves:
            moves[span.step] = span
    return moves


def move_predictions(data: RunFolder) -> dict[int, float]:
    """The cost model's seconds for the plan change before each step: the controller's
    decision (transition DAG or restart cost) where one decided it, else the timeline's
    (a configured plan switch)."""
    predicted = {}
    for step, span in move_spans(data.spans).items():
        value = span.args["predicted_s"]
        if isinstance(value, int | float) and not isinstance(value, bool):
            predicted[step] = float(value)
    for decision in data.decisions:
        if decision.action in PLAN_CHANGES and decision.refused is None and decision.transition_cost_s is not None:
            predicted[decision.step] = decision.transition_cost_s
    return predicted


def _transitions(data: RunFolder) -> list[TransitionTime]:
    spans = move_spans(data.spans)
    predicted = move_predictions(data)
    moves = []
    for record in data.steps:
        phases = record.phase_seconds
        for action in PLAN_CHANGES:
            if action not in phases:
                continue
            span = spans.get(record.step)
            count = span.args.get("num_primitives") if span is not None else None
            moves.append(
                TransitionTime(
                    step=record.step,
                    action=action,
                    measured_s=phases[action],
                    predicted_s=predicted.get(record.step),
                    num_primitives=count if isinstance(count, int) else None,
                )
            )
    return moves


def _error(name: str, pairs: list[tuple[float, float]]) -> PredictionError:
    """(predicted, measured) pairs with a positive measurement."""
    return PredictionError(
        name=name,
        mape_percent=100 * statistics.mean(abs(p - m) / m for p, m in pairs),
        num_steps=len(pairs),
        mean_predicted_s=statistics.mean(p for p, _ in pairs),
        mean_measured_s=statistics.mean(m for _, m in pairs),
    )


def _prediction_errors(steps: list[StepRecord], skipped: list[str]) -> list[PredictionError]:
    names = [name for r in steps for name in r.predicted_stage_seconds if name not in skipped]
    names = list(dict.fromkeys(names))
    errors = []
    for name in names:
        pairs = [
            (r.predicted_stage_seconds[name], r.stage_seconds[name])
            for r in steps
            if name in r.predicted_stage_seconds and r.stage_seconds.get(name, 0.0) > 0
        ]
        if pairs:
            errors.append(_error(name, pairs))
    whole = [(r.predicted_step_seconds, r.step_seconds) for r in steps if r.predicted_step_seconds is not None]
    positive = [(p, m) for p, m in whole if m > 0]
    if positive:
        errors.append(_error("step", positive))
    return errors


def summarise(data: RunFolder) -> RunReport:
    """The report of parsed run data (at least one step)."""
    assert data.steps, "read_run_folder refuses a run without steps"
    step_times = [r.step_seconds for r in data.steps]
    mean_step = statistics.mean(step_times)
    stages = _mean_stage_times(data.steps, mean_step)
    transitions = _transitions(data)
    transition_s = sum(t.measured_s for t in transitions)
    run_s = sum(step_times) + transition_s
    rewards = [r.reward for r in data.steps]
    predicted = dict.fromkeys(name for r in data.steps for name in r.predicted_stage_seconds)
    not_compared: list[str] = [
        name for name in predicted if is_model_stage(name) and not data.config.rl.runs_engine(role_of(name))
    ]
    return RunReport(
        folder=str(data.folder),
        first_step=data.steps[0].step,
        num_steps=len(data.steps),
        run_s=run_s,
        mean_step_s=mean_step,
        median_step_s=statistics.median(step_times),
        stages=stages,
        other_s=mean_step - sum(s.mean_s for s in stages),
        transitions=transitions,
        transition_s=transition_s,
        transition_share=transition_s / run_s if run_s > 0 else 0.0,
        prediction_errors=_prediction_errors(data.steps, not_compared),
        not_compared=not_compared,
        reward_first=statistics.mean(rewards[:REWARD_WINDOW]),
        reward_last=statistics.mean(rewards[-REWARD_WINDOW:]),
        decisions=dict(Counter(d.action for d in data.decisions)),
        num_refused=sum(d.refused is not None for d in data.decisions),
        num_spans=len(data.spans),
        memory=stage_memory(data.steps),
    )


def stage_memory(steps: list[StepRecord]) -> list[StageMemory]:
    """Measured and predicted peak per model-stage: the largest over ranks and steps."""
    rows = []
    for name in dict.fromkeys(n for r in steps for n in r.predicted_memory_peak_bytes_by_stage):
        measured = max(max(r.memory_peak_bytes_by_stage.get(name, []), default=0) for r in steps)
        predicted = max(max(r.predicted_memory_peak_bytes_by_stage.get(name, []), default=0) for r in steps)
        if measured > 0 and predicted > 0:
            rows.append(StageMemory(name, measured, predicted, 100.0 * (measured - predicted) / predicted))
    return rows


def summarise_run(folder: Path, first_step: int = 0) -> RunReport:
    """Read and summarise the run folder `folder`, from step `first_step` on."""
    return summarise(since(read_run_folder(folder), first_step))


# ---------------------------------------------------------------------------------- figure


def report_png(data: RunFolder, dpi: int = 100) -> bytes:
    """Top: per-step stacked bars of model-stage and phase times, the plan change before a step
    stacked on top (hatched), the predicted step time as a line. Bottom: the reward curve."""
    figure = new_figure((11, 6.5))
    times, reward = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    steps = [r.step for r in data.steps]
    bottom = [0.0] * len(steps)
    names = list(dict.fromkeys(name for r in data.steps for name in r.stage_seconds if name not in PLAN_CHANGES))
    colors = _palette(len(names))
    for name, color in zip(names, colors, strict=True):
        heights = [r.stage_seconds.get(name, 0.0) for r in data.steps]
        times.bar(steps, heights, bottom=bottom, width=0.85, color=color, label=name, linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    moves = _transitions(data)
    for action, hatch in zip(PLAN_CHANGES, ("//", "xx"), strict=True):
        heights = [r.stage_seconds.get(action, 0.0) for r in data.steps]
        if any(heights):
            times.bar(steps, heights, bottom=bottom, width=0.85, color="white", edgecolor="crimson",
                      hatch=hatch, label=f"{action} (before the step)")  # fmt: skip
            for step, height in zip(steps, heights, strict=True):
                if height:
                    times.axvline(step, color="crimson", linewidth=0.6, linestyle=":")
            base = dict(zip(steps, bottom, strict=True))
            forecast = [(m.step, base[m.step] + m.predicted_s) for m in moves if m.action == action and m.predicted_s]
            if forecast:
                times.plot(*zip(*forecast, strict=True), linestyle="none", marker="_", markersize=14,
                           markeredgewidth=2, color="crimson", label=f"{action}: predicted")  # fmt: skip
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    predicted = [(r.step, r.predicted_step_seconds) for r in data.steps if r.predicted_step_seconds is not None]
    if predicted:
        times.plot(*zip(*predicted, strict=True), color="black", linewidth=1.2, marker=".", label="predicted step")
    times.set_ylabel("seconds")
    times.set_title(f"{data.folder.name}: measured step time by model-stage (slowest rank)")
    if times.get_legend_handles_labels()[0]:  # a run without recorded parts has nothing to label
        times.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    reward.plot(steps, [r.reward for r in data.steps], color="tab:green", linewidth=1)
    reward.set_ylabel("reward")
    reward.set_xlabel("step")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _palette(count: int) -> list[Any]:
    """Distinct colours (tab20, cycled)."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]
