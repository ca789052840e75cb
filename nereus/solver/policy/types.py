"""What a policy sees (Observation), what it says (Decision), and how it is tuned (PolicyConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nereus.spec.workload import ResponseLengths

Action = Literal["keep", "transition", "restart", "suspend"]
Path = Literal["none", "urgent", "opportunistic"]


@dataclass(frozen=True)
class Observation:
    """The job's conditions at the start of one step, as the runtime measures them."""

    step: int
    """Index of the step about to run."""
    gpus: int
    """GPUs available now (ids 0 .. gpus-1 of the plan's cluster)."""
    response_len: ResponseLengths
    """Current response-length distribution."""
    efficiency: float = 1.0
    """Measured compute efficiency relative to the calibration (1 = as calibrated)."""
    announced_gpus: int | None = None
    """A pool size already announced for a later step (spot notice), or None."""
    announced_step: int | None = None
    """The step the announced pool size takes effect."""
    steps_remaining: int | None = None
    """Steps left in the run including this one, when known; caps the payback horizon."""
    memory_used: float | None = None
    """Measured bytes held on the fullest GPU over its memory capacity (None: not measured);
    above the calibration's usable share the running plan is invalid."""
    recalibrated: bool = False
    """The cost model was refitted since the last observation: efficiencies measured against
    the old one no longer compare, and plans priced with it may rank differently."""


@dataclass(frozen=True)
class Decision:
    """One decision and the inputs it was made from (enough to audit and replay it)."""

    step: int
    action: Action
    """keep the plan, transition (run the DAG), restart (checkpoint + restart), suspend (nothing fits)."""
    path: Path
    """urgent (current plan invalid), opportunistic (a trigger fired), none (no replan)."""
    reason: str
    """One line saying why."""
    triggers: tuple[str, ...] = ()
    """Signals that fired this step (e.g. `seq_len +21%`, `gpus 16->12`)."""
    current_layout: str = ""
    """Compact layout of the plan before the decision ('' when none is running)."""
    target_layout: str = ""
    """Compact layout of the plan the decision moves to ('' for keep and suspend)."""
    current_step_time_s: float | None = None
    """Predicted step time of the current plan now (None when it cannot run)."""
    target_step_time_s: float | None = None
    """Predicted step time of the replanned target."""
    transition_cost_s: float | None = None
    """Critical path of the transition DAG, or the restart cost for a restart."""
    payback_horizon_steps: float | None = None
    """Confidence-adjusted steps until conditions are expected to change again."""
    savings_per_step_s: float | None = None
    """Predicted per-step saving of the target over the current plan."""
    num_gpus_used: int = 0
    """GPUs the plan in force after the decision uses (0 when suspended)."""


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and estimates of the adaptation policy (one default each, here)."""

    length_threshold: float = 0.2
    """Relative change of the mean response length from its reference that triggers a replan."""
    efficiency_threshold: float = 0.1
    """Relative change of measured efficiency from its reference that triggers a replan."""
    horizon_confidence: float = 0.5
    """Share of the estimated steps-until-next-change trusted for payback (reserve for uncertainty)."""
    max_horizon_steps: float = 500.0
    """Horizon when no signal drifts (nothing predicts the next change)."""
    rate_window_steps: int = 50
    """Observations used to estimate each signal's drift rate."""
    growth_margin: float = 0.2
    """Plans are sized for lengths this much longer than measured, to stay feasible until the next trigger."""
    length_grid_ratio: float = 1.05
    """Plans are searched for response lengths rounded up to this geometric grid (plan cache)."""
    efficiency_grid: float = 0.05
    """Efficiency is rounded down to this grid when planning (plan cache)."""
    num_alternatives: int = 3
    """Plans the urgent path may move to: the fastest few, so one whose DAG passes is likelier."""
    restart_overhead_s: float = 120.0
    """Fixed cost of a checkpoint-and-restart: relaunch, rendezvous, communicator set-up."""
    checkpoint_bytes_per_s: float = 2e9
    """Per-GPU storage bandwidth for writing and reading a checkpoint."""

    def __post_init__(self) -> None:
        if not 0 < self.horizon_confidence <= 1:
            raise ValueError(f"horizon_confidence must be in (0, 1], got {self.horizon_confidence}")
        if self.length_threshold <= 0 or self.efficiency_threshold <= 0:
            raise ValueError("thresholds must be positive")
        if self.growth_margin < 0:
            raise ValueError(f"growth_margin must be >= 0, got {self.growth_margin}")
        if self.length_grid_ratio <= 1 or self.efficiency_grid <= 0:
            raise ValueError("length_grid_ratio must exceed 1 and efficiency_grid must be positive")
        if self.num_alternatives < 1:
            raise ValueError(f"num_alternatives must be at least 1, got {self.num_alternatives}")
        if self.rate_window_steps < 2:
            raise ValueError(f"rate_window_steps must be at least 2, got {self.rate_window_steps}")
