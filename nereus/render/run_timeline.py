"""A run's timeline as Chrome trace-event JSON (open it in https://ui.perfetto.dev).

Measured: one process per rank, with tracks for model-stages, phases (advantages,
exchange, weight sync), transitions, their primitives, checkpoints and the controller, in
that order; a kind of span this module does not know gets a track of its own, named by its
category. Spans that overlap (concurrent primitives, say) go to extra lanes of their track
("primitives 2", ...); only a transition's own set-up spans nest inside it on its track.

Predicted (a process of its own, shown first): the cost model's spans beside the measured
ones, taken from metrics.jsonl (prediction of the plan in force, with the online
calibration of that step):
- per step, a `step` span of the predicted step time from the step's measured start
  (the earliest model-stage or phase span of that step over all ranks);
- the predicted model-stage spans laid out from that start: generation, then inference,
  then training, then whatever else was predicted (weight sync), one phase after another
  (the cost model's step breakdown); inside a phase the plan's pools start together and a
  pool runs its model-stages one after another, in the order the metrics list them. The
  pools come from the plan in force (see `run_report.plan_pools`); a step whose plan the
  folder no longer holds puts every model-stage in one pool, i.e. in sequence;
- per plan change (transition or restart), its predicted span from its measured start
  (the controller's predicted cost, else the DAG's makespan: `run_report.move_predictions`)
  and every primitive at the DAG's predicted offsets from that start (once per primitive,
  not per rank).

Times are microseconds from the run's first span.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.render.run_report import move_predictions, move_spans, plan_pools
from nereus.spec.io import write_text_atomic
from nereus.spec.run_folder import TIMELINE_NAME, RunFolder, Span, StepRecord, read_run_folder
from nereus.spec.stages import STAGES, is_model_stage, stage_order

TRACE_NAME = "timeline.json"
US = 1e6
#: Track order and titles of the known span categories; others follow, titled by category.
TRACK_TITLES = {
    "step": "steps",
    "stage": "model-stages",
    "phase": "phases",
    "transition": "transitions",
    "primitive": "primitives",
    "checkpoint": "checkpoints",
    "controller": "controller",
}
#: Categories whose spans contain spans of their own kind (a transition: building engines).
NESTED_CATS = ("transition",)
#: The pool of a model-stage whose plan is unknown (all of them: one after another).
UNKNOWN_POOL = "(plan unknown)"
PREDICTED_PID = 0
#: Slack when deciding whether one span ends before the next starts (clock rounding).
EPS_S = 1e-9


@dataclass(frozen=True)
class Interval:
    """One X event before it gets its track: a category (track group), name, seconds, args."""

    cat: str
    name: str
    start: float
    end: float
    args: dict[str, Any]


def lanes(intervals: list[Interval], nest: bool) -> list[list[Interval]]:
    """Greedy packing into lanes. With `nest`, a lane may hold an interval inside another
    (a plan change and its set-up); otherwise only intervals one after another, so that
    concurrent ones (primitives, pools) sit side by side, never as parent and child."""
    packed: list[tuple[list[Interval], list[float]]] = []  # (lane, ends of its open intervals)
    for interval in sorted(intervals, key=lambda i: (i.start, -i.end)):
        for lane, open_ends in packed:
            while open_ends and open_ends[-1] <= interval.start + EPS_S:
                open_ends.pop()
            if not open_ends or (nest and interval.end <= open_ends[-1] + EPS_S):
                lane.append(interval)
                open_ends.append(interval.end)
                break
        else:
            packed.append(([interval], [interval.end]))
    return [lane for lane, _ in packed]


def track_order(cats: Iterable[str]) -> list[str]:
    known = [cat for cat in TRACK_TITLES if cat in set(cats)]
    return known + sorted(set(cats) - set(TRACK_TITLES))


def process_events(pid: int, title: str, sort_index: int, intervals: list[Interval], origin: float) -> list[Any]:
    """Process and track names, then one X event per interval on its category's lanes."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": title}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": sort_index}},
    ]
    by_cat: dict[str, list[Interval]] = defaultdict(list)
    for interval in intervals:
        by_cat[interval.cat].append(interval)
    tid = 0
    for cat in track_order(by_cat):
        title_of_cat = TRACK_TITLES.get(cat, cat)
        for number, lane in enumerate(lanes(by_cat[cat], nest=cat in NESTED_CATS), start=1):
            tid += 1
            name = title_of_cat if number == 1 else f"{title_of_cat} {number}"
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
            events += [
                {"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": i.name, "ts": (i.start - origin) * US,
                 "dur": (i.end - i.start) * US, "args": i.args}
                for i in lane
            ]  # fmt: skip
    return events


def measured_intervals(spans: list[Span]) -> dict[int, list[Interval]]:
    """Each rank's spans as intervals (args gain the step)."""
    by_rank: dict[int, list[Interval]] = defaultdict(list)
    for span in spans:
        by_rank[span.rank].append(Interval(span.cat, span.name, span.start, span.end, {"step": span.step, **span.args}))
    return by_rank


def stage_layout(predicted: dict[str, float], pools: dict[str, str], start: float) -> list[tuple[str, str, float]]:
    """(model-stage, pool, start) of each predicted model-stage: phases in sequence, pools of a
    phase side by side, a pool's model-stages in sequence."""
    phases: dict[int, list[str]] = defaultdict(list)
    for name in predicted:
        phases[stage_order(name) if is_model_stage(name) else len(STAGES)].append(name)
    placed = []
    phase_start = start
    for number in sorted(phases):
        cursor: dict[str, float] = {}
        for name in phases[number]:
            pool = pools.get(name, UNKNOWN_POOL)
            begin = cursor.get(pool, phase_start)
            placed.append((name, pool, begin))
            cursor[pool] = begin + predicted[name]
        phase_start = max(cursor.values())
    return placed


def predicted_step_intervals(record: StepRecord, start: float, pools: dict[str, str]) -> list[Interval]:
    """The predicted step and model-stage spans of one step, from its measured start."""
    intervals = []
    step: dict[str, Any] = {"step": record.step, "plan_index": record.plan_index}
    if record.predicted_step_seconds is not None:
        args = {**step, "predicted_s": record.predicted_step_seconds, "measured_s": record.step_seconds}
        intervals.append(Interval("step", f"step {record.step}", start, start + record.predicted_step_seconds, args))
    for name, pool, begin in stage_layout(record.predicted_stage_seconds, pools, start):
        seconds = record.predicted_stage_seconds[name]
        args = {**step, "pool": pool, "predicted_s": seconds, "measured_s": record.stage_seconds.get(name)}
        intervals.append(Interval("stage", name, begin, begin + seconds, args))
    return intervals


def predicted_move_intervals(data: RunFolder) -> list[Interval]:
    """Each plan change's predicted span and its primitives' predicted spans, from the
    change's measured start (earliest over ranks)."""
    moves = move_spans(data.spans)
    predictions = move_predictions(data)
    intervals = []
    for step, move in moves.items():
        if step in predictions:
            args = {"step": step, "predicted_s": predictions[step], "measured_s": move.end - move.start}
            intervals.append(Interval("transition", move.name, move.start, move.start + predictions[step], args))
    seen: set[tuple[int, str]] = set()
    for span in data.spans:
        begin, end = span.args.get("predicted_start_s"), span.args.get("predicted_end_s")
        key = (span.step, str(span.args.get("id", span.name)))
        if span.cat != "primitive" or span.step not in moves or key in seen:
            continue
        if not isinstance(begin, int | float) or not isinstance(end, int | float):
            continue
        seen.add(key)
        origin = moves[span.step].start
        args = {k: span.args[k] for k in ("id", "kind", "model_stage") if k in span.args}
        args.update(step=span.step, predicted_start_s=begin, predicted_end_s=end)
        intervals.append(Interval("primitive", span.name, origin + begin, origin + end, args))
    return intervals


def predicted_intervals(data: RunFolder) -> list[Interval]:
    step_starts: dict[int, float] = {}
    for span in data.spans:
        if span.cat in ("stage", "phase"):
            step_starts[span.step] = min(span.start, step_starts.get(span.step, span.start))
    pools = plan_pools(data.folder, data.steps)
    intervals = []
    for record in data.steps:
        if record.step in step_starts:
            start = step_starts[record.step]
            intervals += predicted_step_intervals(record, start, pools.get(record.plan_index, {}))
    return intervals + predicted_move_intervals(data)


def run_trace_payload(data: RunFolder) -> dict[str, Any]:
    """The Chrome trace of parsed run data with at least one span."""
    assert data.spans, "run_trace_payload needs a timeline"
    origin = min(span.start for span in data.spans)
    predicted = predicted_intervals(data)
    events = process_events(PREDICTED_PID, "predicted (cost model)", -1, predicted, origin)
    for rank, intervals in sorted(measured_intervals(data.spans).items()):
        events += process_events(rank + 1, f"rank {rank}", rank, intervals, origin)
    other = {"run": str(data.folder), "origin_unix_s": origin, "num_steps": len(data.steps)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_run_trace(folder: Path, out: Path | None = None) -> Path:
    """Write the run's Chrome trace to `out` (default DIR/timeline.json), atomically; returns the path."""
    data = read_run_folder(folder, need_steps=False)
    if not data.spans:
        raise NereusError(
            f"{folder / TIMELINE_NAME}: no span recorded (no rank-R.jsonl, or empty); runs write it as they go"
        )
    path = folder / TRACE_NAME if out is None else out
    if not path.parent.is_dir():
        raise NereusError(f"{path}: folder {path.parent} does not exist; create it first")
    write_text_atomic(path, json.dumps(run_trace_payload(data), separators=(",", ":")))
    return path
