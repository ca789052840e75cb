"""Per-step timings from verl's and OpenRLHF's logs, as the runs `nereus fit` fits.

verl's file logger writes one JSON object per step, `{"step": N, "data": {metric: value}}`;
its `timing_s/<phase>` metrics time each model-stage. OpenRLHF prints one line per step,
`Global step N: {metric: value, ...}`, whose `timing/<phase>` metrics time whole phases
(generation, experience making, training, weight broadcast). Both map onto nereus's
model-stages (or phases) of the plan the trainer ran: the plan as `nereus export` wrote it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from nereus.cost.fit import STEP_KEY, WARMUP_STEPS, RunRecord, StepSample
from nereus.spec.plan import Plan
from nereus.spec.stages import (
    ACTOR_GENERATION,
    ACTOR_INFERENCE,
    ACTOR_TRAINING,
    CRITIC_INFERENCE,
    CRITIC_TRAINING,
    REFERENCE_INFERENCE,
    REWARD_INFERENCE,
)

#: verl metric -> the nereus model-stage (or `weight_sync`) it times.
VERL_TIMERS = {
    "timing_s/gen": ACTOR_GENERATION,
    "timing_s/old_log_prob": ACTOR_INFERENCE,
    "timing_s/ref": REFERENCE_INFERENCE,
    "timing_s/reward": REWARD_INFERENCE,
    "timing_s/values": CRITIC_INFERENCE,
    "timing_s/update_actor": ACTOR_TRAINING,
    "timing_s/update_critic": CRITIC_TRAINING,
    "timing_s/update_weights": "weight_sync",
}
VERL_STEP = "timing_s/step"
VERL_SIZES = ("prompt_length/max", "response_length/max")
#: OpenRLHF metric -> the nereus phase (the critical path of a workflow stage) it times.
OPENRLHF_TIMERS = {
    "timing/generation": "phase/generation",
    "timing/make_experience": "phase/inference",
    "timing/ppo_train": "phase/training",
    "timing/broadcast": "weight_sync",
}
OPENRLHF_STEP = "timing/step_total"
_OPENRLHF_LINE = re.compile(r"Global step (\d+): \{(.*)\}\s*$")
_OPENRLHF_ITEM = re.compile(r"'([^']+)': (?:np\.float\d+\()?(-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def _kept(path: Path, samples: list[StepSample], warmup_steps: int, missing: str) -> tuple[StepSample, ...]:
    if not samples:
        raise ValueError(f"{path}: {missing}")
    if len(samples) <= warmup_steps:
        raise ValueError(f"{path}: {len(samples)} steps, none after the {warmup_steps} warm-up steps; log more steps")
    return tuple(samples[warmup_steps:])


def read_verl_log(path: Path, plan: Plan, warmup_steps: int = WARMUP_STEPS) -> RunRecord:
    """verl's JSON-lines metrics (file logger) as a run of `plan`, warm-up steps dropped."""
    stages = {entry.model_stage for entry in plan.stages} | {"weight_sync"}
    timers = {key: name for key, name in VERL_TIMERS.items() if name in stages}
    samples = []
    for number, line in enumerate(_lines(path), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number}: not JSON ({exc.msg})") from None
        data = record.get("data", record) if isinstance(record, dict) else None
        if not isinstance(data, dict) or VERL_STEP not in data:
            continue  # validation records and other loggers' lines carry no step timing
        stage_seconds = {timers[k]: _number(path, number, k, v) for k, v in data.items() if k in timers}
        if not stage_seconds:
            continue
        sizes = [data.get(key) for key in VERL_SIZES]
        if not all(isinstance(v, (int, float)) for v in sizes):
            raise ValueError(f"{path}: line {number}: missing {' and '.join(VERL_SIZES)} (verl's length metrics)")
        step = record.get("step", number) if isinstance(record, dict) else number
        seconds = _number(path, number, VERL_STEP, data[VERL_STEP])
        samples.append(StepSample(int(step), int(sizes[0]), int(sizes[1]), seconds, stage_seconds))  # type: ignore[arg-type]
    missing = (
        f"no step has verl's timing metrics ({VERL_STEP} with {', '.join(timers)}); "
        "log with trainer.logger=[console,file]"
    )
    return RunRecord(str(path), plan, _kept(path, samples, warmup_steps, missing))


def read_openrlhf_log(path: Path, plan: Plan, warmup_steps: int = WARMUP_STEPS) -> RunRecord:
    """OpenRLHF's `Global step N: {...}` lines (its stdout) as a run of `plan`, warm-up dropped.

    OpenRLHF logs no longest response, so every step is priced at the plan's own sizes (its
    prompt length and the expected longest response of a step's batch)."""
    w = plan.workload
    longest = round(w.response_len.expected_longest(w.samples_per_step))
    samples = []
    for number, line in enumerate(_lines(path), 1):
        match = _OPENRLHF_LINE.search(line)
        if match is None:
            continue
        items = {key: float(value) for key, value in _OPENRLHF_ITEM.findall(match.group(2))}
        stage_seconds = {name: items[key] for key, name in OPENRLHF_TIMERS.items() if key in items}
        if OPENRLHF_STEP not in items or not stage_seconds:
            continue
        bad = [k for k, v in stage_seconds.items() if not math.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"{path}: line {number}: {bad[0]} is not a finite number of seconds")
        samples.append(StepSample(int(match.group(1)), w.prompt_len, longest, items[OPENRLHF_STEP], stage_seconds))
    missing = (
        "no `Global step N: {...}` line has OpenRLHF's timing metrics "
        f"({OPENRLHF_STEP}, {', '.join(OPENRLHF_TIMERS)})"
    )
    return RunRecord(str(path), plan, _kept(path, samples, warmup_steps, missing))


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    return [line for line in text.splitlines() if line.strip()]


def _number(path: Path, number: int, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: line {number}: {key} must be a finite number of seconds, got {value!r}")
    return float(value)


__all__ = ["STEP_KEY", "read_openrlhf_log", "read_verl_log"]


def read_trainer_runs(trainer: str, logs: list[Path], plans: list[Plan]) -> list[RunRecord]:
    """Each log as a run of its plan (one plan for every log, or one per log), priced as the
    trainer runs that plan: the plan as `nereus export` writes it for that trainer."""
    from nereus.interop.openrlhf import export_openrlhf
    from nereus.interop.verl import export_verl

    if len(plans) not in (1, len(logs)):
        raise ValueError(f"{len(logs)} logs but {len(plans)} plans; give one plan for all logs or one per log")
    export, read = (export_verl, read_verl_log) if trainer == "verl" else (export_openrlhf, read_openrlhf_log)
    ran = [export(plan).exported_plan for plan in plans]
    return [read(log, ran[0] if len(ran) == 1 else ran[i]) for i, log in enumerate(logs)]
