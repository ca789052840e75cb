"""Schedule: a fused (or baseline) pipeline schedule, per node the ordered ops with times.

Written by `nereus schedule fuse -o`; `nereus check` re-runs the evaluator on it. The
`models` section holds the problem (stage times, memory, replica placement) so any other
program can re-check the ops without nereus.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt

from nereus.spec.base import Document, StrictModel


class ScheduleModel(StrictModel):
    """One model's pipeline: per-stage times and memory, and where its replicas run."""

    name: str = Field(min_length=1)
    """Model name the ops refer to, e.g. `actor`."""
    microbatches: int = Field(gt=0)
    """Micro-batches of one step over all replicas."""
    forward: list[NonNegativeFloat] = Field(min_length=1)
    """Forward time of one micro-batch per stage (in `time_unit`)."""
    backward: list[NonNegativeFloat] = Field(min_length=1)
    """Backward time per stage (its input-gradient part when `weight_grad` is set)."""
    weight_grad: list[NonNegativeFloat] | None = None
    """Weight-gradient time per stage when the backward is split."""
    activation: list[NonNegativeFloat] = Field(min_length=1)
    """Activation memory one in-flight micro-batch holds per stage (in `memory_unit`)."""
    replica_nodes: list[list[NonNegativeInt]] = Field(min_length=1)
    """Per replica, the node of each stage."""
    replica_microbatches: list[list[NonNegativeInt]] = Field(min_length=1)
    """Per replica, the micro-batch ids it processes."""


class ScheduleOp(StrictModel):
    """One op on a node: a forward, backward or weight-gradient pass of one micro-batch."""

    model: str
    """Model name (a `models[].name`)."""
    replica: int = Field(ge=0)
    """Replica index of the model."""
    microbatch: int = Field(ge=0)
    """Micro-batch id within the model."""
    stage: int = Field(ge=0)
    """Pipeline stage index within the replica."""
    kind: Literal["F", "B", "W"]
    """F forward, B backward (input gradient when split), W weight gradient."""
    start: float = Field(ge=0)
    """Start time (in `time_unit`)."""
    end: float = Field(ge=0)
    """End time (in `time_unit`)."""


class ScheduleNode(StrictModel):
    """A node's ops in execution order."""

    node: int = Field(ge=0)
    """Node index (pipeline position)."""
    ops: list[ScheduleOp]
    """Ops in the order the node runs them."""


class ExactSummary(StrictModel):
    """What the exact CP-SAT model found."""

    status: Literal["optimal", "feasible", "infeasible", "unknown"]
    """Of the makespan: optimal certifies that no schedule is faster."""
    makespan: NonNegativeFloat | None
    """The exact model's makespan (re-timed with the real durations)."""
    bound: NonNegativeFloat | None
    """Its lower bound on the optimal makespan."""
    peak_memory: NonNegativeFloat | None
    """Peak activation memory of its schedule."""
    memory_optimal: bool
    """Its peak memory is the least among the fastest schedules."""
    wall_s: float = Field(ge=0)
    """Seconds the solver ran."""


class ExactMemorySummary(StrictModel):
    """CP-SAT's least peak activation among schedules as fast as the heuristic's."""

    status: Literal["optimal", "feasible", "infeasible", "unknown"]
    """Of the peak: optimal certifies that no schedule this fast holds less."""
    peak_memory: float | None
    """Peak activation of its schedule."""
    bound: float | None
    """Its lower bound on the least peak at this makespan."""
    makespan: float | None
    """Makespan of its schedule, re-timed with the real durations."""
    wall_s: float = Field(ge=0)
    """Seconds the solver ran."""


class LeanAlternative(StrictModel):
    """A schedule the search built under an activation cap: less memory for a longer makespan."""

    activation_cap: float = Field(ge=0)
    """The per-node activation cap it was built under; a search under this cap starts from it."""
    makespan: float = Field(ge=0)
    """Its makespan (longer than the schedule's)."""
    peak_memory: float = Field(ge=0)
    """Its largest per-node peak activation (lower than the schedule's)."""


class ScheduleSummary(StrictModel):
    """Headline numbers of the schedule, against bounds and baselines."""

    makespan: float = Field(ge=0)
    """Time from the first op's start to the last op's end."""
    lower_bound: float = Field(ge=0)
    """Largest latency lower bound (critical path, node work, average work, arrival + work + tail,
    and the per-node one-machine bound with rank releases and tails)."""
    gap: float
    """makespan / lower_bound - 1 (0 proves the schedule optimal)."""
    peak_memory: float = Field(ge=0)
    """Largest per-node peak activation memory."""
    memory_bound: float = Field(ge=0)
    """Serial 1F1B first-stage peak, the memory reference bound."""
    memory_lower_bound: float | None = Field(default=None, ge=0)
    """Lower bound on the peak of every schedule as fast as this one (None when not computed)."""
    bubble_ratio: float
    """Idle fraction of nodes x makespan."""
    serial_1f1b_makespan: float = Field(ge=0)
    """Actor 1F1B, then critic 1F1B, on the same nodes."""
    serial_chimera_makespan: float = Field(ge=0)
    """Actor Chimera-style, then critic Chimera-style."""
    speedup_vs_serial: float = Field(ge=0)
    """serial_1f1b_makespan / makespan."""
    greedy_makespan: float = Field(ge=0)
    """The greedy list schedule the search started from."""
    search_s: float = Field(ge=0)
    """Wall seconds of the search (greedy, bounds and annealing)."""
    seeds: int = Field(ge=1)
    """Annealing seeds run in parallel."""
    exact: ExactSummary | None = None
    """The exact model's result when `--exact` was given."""
    exact_memory: ExactMemorySummary | None = None
    """The exact model's least peak at this schedule's makespan when `--exact` was given."""
    lean_alternatives: list[LeanAlternative] = Field(default_factory=list)
    """The trade-off the search found: leaner schedules than this one, each slower, least
    memory first; none is both leaner and faster than another."""


class Schedule(Document):
    """A pipeline schedule: the problem, each node's ordered ops, and a summary."""

    kind: Literal["Schedule"] = "Schedule"
    time_unit: str = ""
    """Unit of every time (`s` when derived from a plan; empty when given unitless)."""
    memory_unit: str = ""
    """Unit of every memory amount (`GiB` when derived from a plan)."""
    num_nodes: int = Field(gt=0)
    """Pipeline nodes (GPU groups of equal size)."""
    p2p_latency: float = Field(default=0.0, ge=0)
    """Added to every dependency between two different nodes."""
    activation_cap: NonNegativeFloat | None = None
    """Per-node activation memory limit the schedule respects; null for none."""
    models: list[ScheduleModel] = Field(min_length=1)
    """The models (actor first) and their placement."""
    nodes: list[ScheduleNode] = Field(min_length=1)
    """Per node, its ops in execution order with start and end times."""
    summary: ScheduleSummary
    """Headline numbers (recomputed and compared by `nereus check`)."""
