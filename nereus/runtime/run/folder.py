"""The run folder made ready for the ranks (its layout is `nereus.spec.run_folder`'s): the
config and plans written, what a resume will redo dropped (metrics, samples, decisions and
spans of later steps, temporary folders of an interrupted save), damaged checkpoints set
aside, and a pool change recorded. Torch-free: the launcher does it before spawning.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from nereus.runtime.observe import timeline
from nereus.runtime.rl.run_data import REWARD_ERRORS_NAME
from nereus.runtime.run.run_setup import Move, RunSetup
from nereus.runtime.run.torchrun import torchrun_restart
from nereus.spec.io import keep_json_lines, save_document, write_text_atomic
from nereus.spec.run_folder import (
    CALIBRATION_NAME,
    CHECKPOINTS_NAME,
    CONFIG_NAME,
    DAMAGED_NAME,
    DECISIONS_NAME,
    FAILURE_NAME,
    METRICS_NAME,
    PLAN_NAME,
    SAMPLES_NAME,
    TRACE_NAME,
    read_metrics,
    switch_plan_name,
)


def prepare_folder(setup: RunSetup) -> None:
    """Write the config and plan, drop what a resume will redo (metrics of steps after the
    checkpoint, temporary folders of an interrupted save) and the previous failure log."""
    out = setup.out
    out.mkdir(parents=True, exist_ok=True)
    if setup.start_step == 0:  # a resume keeps the run's files as they are
        switches = [
            switch.model_copy(update={"plan": switch_plan_name(switch.step)}) for switch in setup.config.plan_switches
        ]
        for switch, checked in zip(switches, setup.switches, strict=True):
            save_document(checked.move.plan, out / switch.plan)
        trace = calibration = None
        if setup.trace is not None:
            trace = TRACE_NAME
            save_document(setup.trace, out / TRACE_NAME)
        if setup.calibration is not None:
            calibration = CALIBRATION_NAME
            save_document(setup.calibration, out / CALIBRATION_NAME)
        copies = {"plan": PLAN_NAME, "plan_switches": switches, "trace": trace, "calibration": calibration}
        config = setup.config.model_copy(update=copies)
        save_document(config, out / CONFIG_NAME)
        save_document(setup.plan, out / PLAN_NAME)
    else:
        save_document(setup.config, out / CONFIG_NAME)
        if not setup.config.plan_switches:
            save_document(setup.plan, out / PLAN_NAME)
    kept = [record for record in read_metrics(out) if record["step"] < setup.start_step]
    write_text_atomic(out / METRICS_NAME, "".join(json.dumps(record) + "\n" for record in kept))
    # The controller's decisions before the steps a resume decides again.
    keep_json_lines(out / DECISIONS_NAME, lambda record: record["observation"]["step"] < setup.start_step)
    keep_json_lines(out / SAMPLES_NAME, lambda record: record["step"] < setup.start_step)
    keep_json_lines(out / REWARD_ERRORS_NAME, lambda record: record["step"] < setup.start_step)
    timeline.drop_steps_from(out, setup.start_step)
    root = out / CHECKPOINTS_NAME
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
    set_aside(setup.damaged, out / DAMAGED_NAME)
    (out / FAILURE_NAME).unlink(missing_ok=True)


def set_aside(folders: tuple[Path, ...], into: Path) -> None:
    """Move damaged checkpoints out of the checkpoints folder (a later save may take their step)."""
    for folder in folders:
        into.mkdir(exist_ok=True)
        target = into / folder.name
        suffix = 1
        while target.exists():
            target, suffix = into / f"{folder.name}.{suffix}", suffix + 1
        os.rename(folder, target)


def log_plan_switch(out: Path, step: int, move: Move, engine: str, measured_s: float) -> None:
    """Record in decisions.jsonl a configured plan switch the ranks made before `step`: the
    transition DAG's predicted makespan (with the engine restarts it prices) beside what it cost
    the slowest rank, as the controller records its own moves."""
    record = {
        "observation": {"step": step, "event": "plan_switch"},
        "decision": {"step": step, "action": move.action, "transition_cost_s": move.predicted_s},
        "runtime": None,
        "engine": engine,
        "measured_cost_s": measured_s,
    }
    append_json_line(out / DECISIONS_NAME, record)


def log_pool_restart(setup: RunSetup, world_size: int, previous: int | None) -> None:
    """Record in decisions.jsonl that the pool changed under the run (torchrun restarted its
    workers) and what the run did: go on from its checkpoint, replanned for `world_size`."""
    event = {"step": setup.start_step, "event": "pool", "restart": torchrun_restart(), "gpus": world_size}
    action = "replan" if setup.planned else "restart"
    record = {
        "observation": {**event, "previous_gpus": previous},
        "decision": {"step": setup.start_step, "action": action, "transition_cost_s": None},
        "runtime": None,
        "checkpoint": None if setup.checkpoint is None else setup.checkpoint.name,
    }
    append_json_line(setup.out / DECISIONS_NAME, record)


def append_json_line(path: Path, record: Any) -> None:
    """Append `record` to the JSON-lines log at `path` as one line, flushed as the file closes
    (the launcher and a killed run see it)."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
