"""Rank 0's run state as data: the schema of a run checkpoint's controller.json and its reader.

The Predictor and the Controller (`rl/controller.py`) save themselves as these models and are
rebuilt from them; the checkpoint checks (`run/checkpoints.py`) validate the file without building
either, so this module sits below both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from nereus.cost.calibration import Calibration
from nereus.cost.online import CalibratorState
from nereus.errors import NereusError
from nereus.solver.policy import PolicyState
from nereus.spec.base import StrictModel
from nereus.spec.plan import Plan
from nereus.spec.workload import ResponseLengths


class PredictionState(StrictModel):
    """The Predictor's last prediction and what it priced."""

    plan: Plan
    prompt_len: int
    response_len_max: int
    calibration: Calibration
    predicted: dict[str, float]
    """Seconds per predicted key."""


class PendingState(StrictModel):
    """A finished step whose online update waits for the next step."""

    plan: Plan
    metrics: dict[str, Any]
    """The step's StepMetrics as metrics.jsonl holds them."""


class PredictorState(StrictModel):
    """A Predictor between steps, as data."""

    calibration: Calibration
    """The calibration the next step is predicted with."""
    calibrator: CalibratorState | None
    """The online calibrator (None: online calibration off)."""
    last: PredictionState | None
    pending: PendingState | None


class ControllerState(StrictModel):
    """A Controller between decisions, as data (the trace, config and run folder come from the run)."""

    plan: Plan
    """The plan in force."""
    policy: PolicyState
    lengths: ResponseLengths
    """The last measured response lengths."""
    efficiency: float
    memory_used: float | None
    ratios: list[float]
    """The recent predicted/measured ratios the efficiency is the median of."""
    recalibrated: bool


#: The `format` of a run checkpoint's run-state file.
RUN_STATE_FORMAT: Literal["nereus-run-state"] = "nereus-run-state"


class RunStateData(StrictModel):
    """Rank 0's run state inside a run checkpoint (controller.json): plain JSON, validated on read."""

    format: Literal["nereus-run-state"] = RUN_STATE_FORMAT
    """Always `nereus-run-state`."""
    version: Literal[1] = 1
    """Schema version; this release reads 1."""
    predictor: PredictorState
    controller: ControllerState | None
    """None for a run without a trace (no controller)."""
    plan_index: int
    """Plan changes so far (metrics' plan_index)."""


def read_run_state(path: Path) -> RunStateData:
    """The validated run state at `path`; NereusError naming the file and the field otherwise."""
    from pydantic import ValidationError

    from nereus.spec.io import format_loc

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise NereusError(f"{path}: unreadable ({error}); the checkpoint is damaged") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise NereusError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno}); the checkpoint is damaged"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != RUN_STATE_FORMAT:
        raise NereusError(f"{path}: format: must be {RUN_STATE_FORMAT!r}; not a nereus run state")
    if raw.get("version") != 1:
        raise NereusError(f"{path}: version: {raw.get('version')!r} is not one this nereus reads (1)")
    try:
        return RunStateData.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        raise NereusError(f"{path}: {format_loc(first['loc'])}: {first['msg']}; the checkpoint is damaged") from None
