"""A finished (or running) `nereus run` folder, read back and summarised: `nereus report DIR`.

`read_run` parses the folder's files into typed records (metrics.jsonl, decisions.jsonl,
timeline/rank-R.jsonl), refusing a malformed line with one error naming the file and line;
`summarise` turns them into a `RunReport` (step-time breakdown, transitions and their share
of the run, cost-model error per model-stage, rewards, decisions by action); `report_png`
draws the per-step figure. Nothing here imports torch; matplotlib only inside `report_png`.

Run time is the sum of the steps' wall times plus the transitions' (a step's `step_seconds`
excludes the plan change before it, which metrics record as `transition` or `restart`).
"""

from __future__ import annotations

import io
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.render import new_figure
from nereus.runtime.rl.config import RunConfig
from nereus.runtime.rl.controller import DECISIONS_NAME
from nereus.runtime.rl.setup import CHECKPOINTS_NAME, CONFIG_NAME, METRICS_NAME, PLAN_NAME, switch_plan_name
from nereus.runtime.timeline import TIMELINE_NAME
from nereus.spec.io import read_utf8

#: stage_seconds entries that are plan changes before the step, not part of it.
MOVE_ACTIONS = ("transition", "restart")
#: Steps averaged for the first and last reward.
REWARD_WINDOW = 10


@dataclass(frozen=True)
class StepRecord:
    """The fields of one metrics.jsonl line that the report and the timeline use."""

    step: int
    reward: float
    step_seconds: float
    """Wall time of the step on the slowest rank (without the plan change before it)."""
    stage_seconds: dict[str, float]
    """Per model-stage and phase; `transition`/`restart` when the plan changed before the step."""
    predicted_step_seconds: float | None = None
    """The cost model's step time for the plan in force (None in runs that did not record it)."""
    predicted_stage_seconds: dict[str, float] = field(default_factory=dict)
    plan_index: int = 0
    """Which plan is in force: 0 for the first, +1 at every transition or restart."""


@dataclass(frozen=True)
class Span:
    """One line of timeline/rank-R.jsonl: something rank `rank` did during `step`."""

    rank: int
    step: int
    cat: str
    """stage, phase, transition, primitive, checkpoint, controller, or a later kind."""
    name: str
    start: float
    """time.time() seconds."""
    end: float
    args: dict[str, Any]


@dataclass(frozen=True)
class Decision:
    """One controller decision (decisions.jsonl)."""

    step: int
    action: str
    transition_cost_s: float | None
    refused: str | None
    """Why the runtime refused the policy's target plan (the plan was kept), or None."""


@dataclass(frozen=True)
class RunData:
    """Everything read from a run folder."""

    folder: Path
    config: RunConfig
    steps: list[StepRecord]
    decisions: list[Decision]
    spans: list[Span]
    """Empty when the run wrote no timeline."""


# ---------------------------------------------------------------------------------- reading


def _number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NereusError(f"{where}: {key}: expected a finite number, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NereusError(f"{where}: {key}: expected an integer, got {value!r}")
    return value


def _seconds_map(value: Any, where: str, key: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise NereusError(f"{where}: {key}: expected an object of seconds, got {value!r}")
    return {str(name): _number(seconds, where, f"{key}.{name}") for name, seconds in value.items()}


def _json_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) per non-blank line; `where` names the file and line for errors."""
    rows = []
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            data = json.loads(line)
        except ValueError:
            raise NereusError(f"{where}: not JSON (a truncated or damaged line); fix or delete the line") from None
        if not isinstance(data, dict):
            raise NereusError(f"{where}: expected a JSON object, got {type(data).__name__}")
        rows.append((where, data))
    return rows


def _required(data: dict[str, Any], where: str, key: str, parent: str = "") -> Any:
    if key not in data:
        raise NereusError(f"{where}: missing field {parent + key!r}")
    return data[key]


def _step_record(where: str, data: dict[str, Any]) -> StepRecord:
    predicted = data.get("predicted_step_seconds")
    return StepRecord(
        step=_integer(_required(data, where, "step"), where, "step"),
        reward=_number(_required(data, where, "reward"), where, "reward"),
        step_seconds=_number(_required(data, where, "step_seconds"), where, "step_seconds"),
        stage_seconds=_seconds_map(_required(data, where, "stage_seconds"), where, "stage_seconds"),
        predicted_step_seconds=None if predicted is None else _number(predicted, where, "predicted_step_seconds"),
        predicted_stage_seconds=_seconds_map(
            data.get("predicted_stage_seconds") or {}, where, "predicted_stage_seconds"
        ),
        plan_index=_integer(data.get("plan_index", 0), where, "plan_index"),
    )


def _span(where: str, data: dict[str, Any]) -> Span:
    args = data.get("args", {})
    if not isinstance(args, dict):
        raise NereusError(f"{where}: args: expected an object, got {args!r}")
    span = Span(
        rank=_integer(_required(data, where, "rank"), where, "rank"),
        step=_integer(_required(data, where, "step"), where, "step"),
        cat=str(_required(data, where, "cat")),
        name=str(_required(data, where, "name")),
        start=_number(_required(data, where, "start"), where, "start"),
        end=_number(_required(data, where, "end"), where, "end"),
        args=args,
    )
    if span.end < span.start:
        raise NereusError(f"{where}: end {span.end} is before start {span.start}")
    return span


def _decision(where: str, data: dict[str, Any]) -> Decision:
    decision = _required(data, where, "decision")
    if not isinstance(decision, dict):
        raise NereusError(f"{where}: decision: expected an object, got {decision!r}")
    cost = decision.get("transition_cost_s")
    refused = data.get("runtime")
    return Decision(
        step=_integer(_required(decision, where, "step", "decision."), where, "decision.step"),
        action=str(_required(decision, where, "action", "decision.")),
        transition_cost_s=None if cost is None else _number(cost, where, "decision.transition_cost_s"),
        refused=None if refused is None else str(refused),
    )


def run_config(folder: Path) -> RunConfig:
    """The run folder's config (one line when `folder` is not a run folder)."""
    from nereus.spec.io import load_document

    if not folder.is_dir():
        raise NereusError(f"{folder}: no such folder; pass the --out folder of a `nereus run`")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise NereusError(
            f"{folder}: not a run folder ({CONFIG_NAME} missing); pass the --out folder of a `nereus run`"
        )
    config = load_document(path)
    if not isinstance(config, RunConfig):
        raise NereusError(f"{path}: kind: expected RunConfig, got {type(config).__name__}; is {folder} a run folder?")
    return config


def read_spans(folder: Path) -> list[Span]:
    """Every rank's spans, by start time (empty when the run wrote no timeline)."""
    spans = []
    for path in sorted((folder / TIMELINE_NAME).glob("rank-*.jsonl")):
        for where, data in _json_lines(path):
            spans.append(_span(where, data))
    return sorted(spans, key=lambda span: (span.start, span.rank))


def read_run(folder: Path, need_steps: bool = True) -> RunData:
    """Parse a run folder; with `need_steps`, a run without a finished step is refused."""
    config = run_config(folder)
    metrics = folder / METRICS_NAME
    steps = [_step_record(where, data) for where, data in _json_lines(metrics)] if metrics.is_file() else []
    if need_steps and not steps:
        raise NereusError(f"{metrics}: no finished step recorded yet; report a run once its first step is done")
    decisions_path = folder / DECISIONS_NAME
    decisions = (
        [_decision(where, data) for where, data in _json_lines(decisions_path)] if decisions_path.is_file() else []
    )
    return RunData(folder, config, steps, decisions, read_spans(folder))


def since(data: RunData, first_step: int) -> RunData:
    """The run from step `first_step` on (e.g. past the warm-up steps); one line if none is left."""
    steps = [record for record in data.steps if record.step >= first_step]
    if not steps:
        last = max((record.step for record in data.steps), default=-1)
        raise NereusError(f"--from-step {first_step}: {data.folder} has steps 0-{last}; pick one of them")
    decisions = [decision for decision in data.decisions if decision.step >= first_step]
    spans = [span for span in data.spans if span.step >= first_step]
    return RunData(data.folder, data.config, steps, decisions, spans)


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


def _mean_stage_times(steps: list[StepRecord], mean_step: float) -> list[StageTime]:
    names = list(dict.fromkeys(name for r in steps for name in r.stage_seconds if name not in MOVE_ACTIONS))
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


def move_predictions(data: RunData) -> dict[int, float]:
    """The cost model's seconds for the plan change before each step: the controller's
    decision (transition DAG or restart cost) where one decided it, else the timeline's
    (a configured plan switch)."""
    predicted = {}
    for step, span in move_spans(data.spans).items():
        value = span.args["predicted_s"]
        if isinstance(value, int | float) and not isinstance(value, bool):
            predicted[step] = float(value)
    for decision in data.decisions:
        if decision.action in MOVE_ACTIONS and decision.refused is None and decision.transition_cost_s is not None:
            predicted[decision.step] = decision.transition_cost_s
    return predicted


def _transitions(data: RunData) -> list[TransitionTime]:
    spans = move_spans(data.spans)
    predicted = move_predictions(data)
    moves = []
    for record in data.steps:
        for action in MOVE_ACTIONS:
            if action not in record.stage_seconds:
                continue
            span = spans.get(record.step)
            count = span.args.get("num_primitives") if span is not None else None
            moves.append(
                TransitionTime(
                    step=record.step,
                    action=action,
                    measured_s=record.stage_seconds[action],
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


def summarise(data: RunData) -> RunReport:
    """The report of parsed run data (at least one step)."""
    assert data.steps, "read_run refuses a run without steps"
    step_times = [r.step_seconds for r in data.steps]
    mean_step = statistics.mean(step_times)
    stages = _mean_stage_times(data.steps, mean_step)
    transitions = _transitions(data)
    transition_s = sum(t.measured_s for t in transitions)
    run_s = sum(step_times) + transition_s
    rewards = [r.reward for r in data.steps]
    predicted = dict.fromkeys(name for r in data.steps for name in r.predicted_stage_seconds)
    not_compared = [name for name in predicted if not data.config.rl.runs_engine(name.partition("/")[0])]
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
    )


def summarise_run(folder: Path, first_step: int = 0) -> RunReport:
    """Read and summarise the run folder `folder`, from step `first_step` on."""
    return summarise(since(read_run(folder), first_step))


# ---------------------------------------------------------------------------------- figure


def report_png(data: RunData, dpi: int = 100) -> bytes:
    """Top: per-step stacked bars of model-stage and phase times, the plan change before a step
    stacked on top (hatched), the predicted step time as a line. Bottom: the reward curve."""
    figure = new_figure("--png", (11, 6.5))
    times, reward = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    steps = [r.step for r in data.steps]
    bottom = [0.0] * len(steps)
    names = list(dict.fromkeys(name for r in data.steps for name in r.stage_seconds if name not in MOVE_ACTIONS))
    colors = _palette(len(names))
    for name, color in zip(names, colors, strict=True):
        heights = [r.stage_seconds.get(name, 0.0) for r in data.steps]
        times.bar(steps, heights, bottom=bottom, width=0.85, color=color, label=name, linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    moves = _transitions(data)
    for action, hatch in zip(MOVE_ACTIONS, ("//", "xx"), strict=True):
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
