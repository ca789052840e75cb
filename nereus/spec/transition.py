"""Transition: the scheduled DAG of primitives that turns one plan into another.

Written by `nereus dag build`, read by `nereus dag show` and `nereus check`. It embeds
both plans, so it is self-contained: the checker can replay every primitive and the
summary can be recomputed to tell whether the file is stale.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field, NonNegativeInt

from nereus.spec.base import Document, StrictModel
from nereus.spec.check import Problem, plan_problems
from nereus.spec.plan import Plan
from nereus.spec.stages import ModelStageName

PrimitiveKindName = Literal["split", "destroy", "extend", "merge"]


class LayoutRecord(StrictModel):
    """The (tp, pp) layout of one replica."""

    tp: int = Field(gt=0)
    """Tensor-parallel degree."""
    pp: int = Field(gt=0)
    """Pipeline-parallel degree."""


class GpuBytes(StrictModel):
    """A number of bytes on one GPU."""

    gpu: int = Field(ge=0)
    """GPU id in the cluster."""
    bytes: float = Field(ge=0)
    """Bytes on that GPU."""


class TransferRecord(StrictModel):
    """One point-to-point copy of a primitive."""

    source: int = Field(ge=0)
    """GPU the bytes are read from."""
    target: int = Field(ge=0)
    """GPU the bytes are written to."""
    bytes: float = Field(ge=0)
    """Bytes copied."""


class EmuRecord(StrictModel):
    """One replica (EMU) of the primitive's model-stage."""

    tp: int = Field(gt=0)
    """Tensor-parallel degree of the replica."""
    pp: int = Field(gt=0)
    """Pipeline-parallel degree of the replica."""
    gpus: list[NonNegativeInt] = Field(min_length=1)
    """Ordered GPU ids: GPU of (pp stage s, tp rank r) is entry s * tp + r."""


class PrimitiveRecord(StrictModel):
    """One scheduled Split, Destroy, Extend or Merge."""

    id: int = Field(ge=0)
    """Position in `primitives`; edges refer to it."""
    kind: PrimitiveKindName
    """split: re-shard to a finer layout on the same GPUs; destroy: drop a replica;
    extend: copy a replica to new GPUs; merge: fuse replicas into one coarser replica."""
    model_stage: ModelStageName
    """The model-stage whose state this primitive moves."""
    source_layout: LayoutRecord
    """Layout of the replicas the primitive starts from."""
    target_layout: LayoutRecord
    """Layout of the replicas it produces."""
    gpus_read: list[NonNegativeInt]
    """GPUs whose state is read (sources of the copies)."""
    gpus_written: list[NonNegativeInt]
    """GPUs whose state is written."""
    alloc_bytes: list[GpuBytes]
    """Bytes allocated per GPU when the primitive starts."""
    free_bytes: list[GpuBytes]
    """Bytes released per GPU when the primitive ends."""
    transfers: list[TransferRecord] = Field(default_factory=list)
    """Every copy, so the checker can replay which GPU holds what."""
    bytes_intra_node: float = Field(ge=0)
    """Bytes copied between GPUs of one node."""
    bytes_inter_node: float = Field(ge=0)
    """Bytes copied between nodes."""
    new_groups: int = Field(default=0, ge=0)
    """Process groups (communicators) the primitive creates."""
    start_s: float = Field(ge=0)
    """Predicted start, seconds after the transition begins."""
    end_s: float = Field(ge=0)
    """Predicted end, seconds after the transition begins."""
    depends_on: list[NonNegativeInt] = Field(default_factory=list)
    """Data edges: ids of primitives whose output this one needs."""
    ownership_deps: list[NonNegativeInt] = Field(default_factory=list)
    """GPU-ownership edges: ids of primitives (of other model-stages) that had to release
    memory on a shared GPU before this one could allocate."""
    removes: list[EmuRecord] = Field(default_factory=list)
    """Replicas that stop being complete copies when it starts."""
    retires: list[EmuRecord] = Field(default_factory=list)
    """Replicas that stop being replicas when it ends (their data lives on in `adds`)."""
    adds: list[EmuRecord] = Field(default_factory=list)
    """Replicas that become complete copies when it ends."""
    copies_from: list[EmuRecord] = Field(default_factory=list)
    """Replicas it reads (an Extend's source): each must be a complete copy while it runs."""

    @property
    def gpus(self) -> list[int]:
        """Every GPU the primitive occupies."""
        used = {*self.gpus_read, *self.gpus_written}
        used.update(entry.gpu for entry in self.alloc_bytes)
        used.update(entry.gpu for entry in self.free_bytes)
        return sorted(used)


class LinkBytes(StrictModel):
    """Bytes copied per link class."""

    intra_node: float = Field(ge=0)
    """Bytes copied between GPUs of one node."""
    inter_node: float = Field(ge=0)
    """Bytes copied between nodes."""


class TransitionSummary(StrictModel):
    """What the whole transition costs, as computed when the file was written."""

    makespan_s: float = Field(ge=0)
    """Predicted time from the first primitive's start to the last one's end."""
    bytes_moved: float = Field(ge=0)
    """Bytes copied by all primitives."""
    lower_bound_bytes: float = Field(ge=0)
    """Bytes every GPU must end up holding that it does not hold yet: no order moves less."""
    bytes_by_link: LinkBytes
    """`bytes_moved` split by link class."""
    initial_bytes: list[GpuBytes] = Field(default_factory=list)
    """Model state per GPU before the transition (plan `source`)."""
    peak_extra_bytes: list[GpuBytes] = Field(default_factory=list)
    """Highest memory per GPU above its initial state during the transition."""
    capacity_bytes: float = Field(ge=0)
    """Bytes per GPU model state may fill: the usable capacity (device memory less headroom)
    less the workspace."""
    feasible: bool
    """True when every primitive fits in memory in the scheduled order."""
    blocking_cycle: list[str] = Field(default_factory=list)
    """When infeasible: which model-stages wait for memory another one holds."""


class ExactRecord(StrictModel):
    """An exact solver's schedule of the same primitives (a baseline for the heuristic)."""

    solver: str = Field(min_length=1)
    """Solver name, e.g. `cpsat` or `scip`."""
    status: str = Field(min_length=1)
    """Solver status, e.g. `OPTIMAL`, `FEASIBLE`, `INFEASIBLE`, `UNKNOWN`."""
    makespan_s: float | None = Field(default=None, ge=0)
    """Makespan of the best schedule found; absent when none was found."""
    bound_s: float | None = Field(default=None, ge=0)
    """Proven lower bound on the makespan; absent when the solver gave none."""
    time_limit_s: float = Field(ge=0)
    """Time limit the solver ran under."""
    wall_s: float = Field(ge=0)
    """Seconds the solver ran."""
    detail: str | None = None
    """The solver's own words (status, horizon, why infeasible), when it gave any."""


class Transition(Document):
    """A scheduled transition DAG from plan `source` to plan `target`."""

    kind: Literal["Transition"] = "Transition"
    source: Plan
    """The plan the job runs before the transition."""
    target: Plan
    """The plan the job runs after the transition."""
    primitives: list[PrimitiveRecord] = Field(default_factory=list)
    """Every primitive, in id order."""
    summary: TransitionSummary
    """Makespan, bytes moved and memory of the whole transition."""
    exact: list[ExactRecord] | None = None
    """Exact-solver baselines (`nereus dag build --exact`), when asked for."""


def _prefixed(problems: Iterator[Problem], prefix: str) -> Iterator[Problem]:
    for problem in problems:
        path = problem.path if problem.path.startswith("[") else f".{problem.path}"
        yield Problem(f"{prefix}{path}", problem.message, problem.severity)


def transition_structure_problems(transition: Transition) -> Iterator[Problem]:
    """What a schema cannot say: valid plans, one cluster, edges to existing primitives."""
    yield from _prefixed(plan_problems(transition.source), "source")
    yield from _prefixed(plan_problems(transition.target), "target")
    if transition.source.cluster != transition.target.cluster:
        yield Problem("target.cluster", "differs from source.cluster; a transition runs on one cluster")
    before = {entry.model_stage for entry in transition.source.stages}
    after = {entry.model_stage for entry in transition.target.stages}
    if before != after:
        yield Problem("target.stages", f"the plans run different model-stages: {sorted(before ^ after)}")
    num_gpus = transition.target.cluster.num_gpus
    count = len(transition.primitives)
    for i, primitive in enumerate(transition.primitives):
        at = f"primitives[{i}]"
        if primitive.id != i:
            yield Problem(f"{at}.id", f"ids are positions: expected {i}, got {primitive.id}")
        if primitive.end_s < primitive.start_s:
            yield Problem(f"{at}.end_s", f"ends at {primitive.end_s} s, before its start {primitive.start_s} s")
        for key in ("depends_on", "ownership_deps"):
            for j, dep in enumerate(getattr(primitive, key)):
                if not 0 <= dep < count or dep == i:
                    what = "itself" if dep == i else f"no primitive {dep}"
                    yield Problem(f"{at}.{key}[{j}]", f"refers to {what}; use ids 0..{count - 1} other than {i}")
        for key in ("alloc_bytes", "free_bytes"):
            gpus = [entry.gpu for entry in getattr(primitive, key)]
            if len(set(gpus)) != len(gpus):
                yield Problem(f"{at}.{key}", "lists a GPU twice; give one entry per GPU")
        bad = [gpu for gpu in primitive.gpus if gpu >= num_gpus]
        if bad:
            yield Problem(at, f"GPU {bad[0]} does not exist; the cluster has GPUs 0..{num_gpus - 1}")
    summary = transition.summary
    if summary.feasible == bool(summary.blocking_cycle):
        yield Problem(
            "summary.feasible",
            "a feasible transition has no blocking cycle and an infeasible one names it; make them agree",
        )
