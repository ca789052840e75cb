"""What a run is set up with before any rank exists (`RunSetup`), and the plan changes its
ranks make on the way (`Move`, `Switch`): plain data, built once by the launcher (or a
torchrun job's rank 0) and handed to every rank as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nereus.cost.calibration import Calibration
from nereus.runtime.rl.run_data import RunData
from nereus.spec.plan import Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.trace import Trace

if TYPE_CHECKING:
    from nereus.solver.transition.primitives import Primitive
    from nereus.solver.transition.primitives import Schedule as TransitionSchedule
    from nereus.spec.schedule import Schedule


@dataclass(frozen=True)
class Move:
    """A plan change the ranks carry out before a step, the same on every rank."""

    action: str
    """`transition` (live, through the DAG) or `restart` (through a checkpoint)."""
    plan: Plan
    """The plan in force from then on."""
    primitives: list[Primitive]
    """The scheduled transition DAG (empty for a restart), built once by one process: every
    rank must walk the very same primitives."""
    transition_schedule: TransitionSchedule
    """The DAG's schedule (empty for a restart): the order the ranks
    walk the primitives in."""
    predicted_s: float
    """The DAG's predicted makespan."""
    fused_schedule: Schedule | None = None
    """The new plan's fused schedule (`plans.plan_schedule`), searched once by the process
    that made the move."""


@dataclass(frozen=True)
class Switch:
    """A checked `plan_switches` entry: before `step`, `move`."""

    step: int
    move: Move


@dataclass(frozen=True)
class RunSetup:
    """A run ready to spawn: what to run, on how many ranks, where, and from which step."""

    config: RunConfig
    """The effective config (`num_steps` as overridden by `--steps`)."""
    plan: Plan
    num_ranks: int
    out: Path
    """The run folder."""
    start_step: int
    """First step to run: 0, or the step of the checkpoint resumed from."""
    checkpoint: Path | None
    """The checkpoint folder a resume loads (None for a new run or one never checkpointed)."""
    planned: bool
    """True when the plan was made by the planner for `num_ranks` (a resume onto other ranks)."""
    switches: tuple[Switch, ...] = ()
    """Plan switches still ahead (from `start_step` on: a checkpoint holds the plan before them)."""
    trace: Trace | None = None
    """GPU-pool events for the online controller (None: no controller)."""
    calibration: Calibration | None = None
    """The cost model's starting calibration (None: the default one)."""
    damaged: tuple[Path, ...] = ()
    """Damaged checkpoints newer than `checkpoint`, moved aside before the run starts."""
    data: RunData | None = None
    """The run's tokenizer and encoded prompts (None: the character tokenizer and the task)."""
    fused_schedule: Schedule | None = None
    """The fused schedule of `plan` under `fusion.intra_stage` (`plans.plan_schedule`),
    searched once by `resolve` (None: no intra-stage fusion, or a setup made by hand: each
    rank then searches it once)."""
